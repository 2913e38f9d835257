"""The wheel as a package index ships it: every package of the source tree, the folders mapped into
bagualu_plugin (recipes/, kernels/) with the recipes' YAML, and nothing else at the top level. An
editable install imports the source folders, which once hid a wheel without bagualu_plugin.sim."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"recipes": "bagualu_plugin/recipes", "kernels": "bagualu_plugin/kernels"}  # source folder -> where the wheel has it
TOP_LEVEL = {"bagualu_plugin", "bagualu_plugin-0.1.0.dist-info"}

pytestmark = pytest.mark.multiprocess  # every test reads the wheel `pip wheel` builds in a subprocess


def expected_files(root: Path) -> set[str]:
    """Wheel paths of every module of every package (a folder with an __init__.py) under
    bagualu_plugin/ and the mapped folders, and of every recipe YAML."""
    places = {"bagualu_plugin": "bagualu_plugin", **MAPPED}
    files = set()
    for folder, target in places.items():
        for init in (root / folder).rglob("__init__.py"):
            files |= {f"{target}/{p.relative_to(root / folder).as_posix()}" for p in init.parent.glob("*.py")}
    files |= {f"{MAPPED['recipes']}/{p.relative_to(root / 'recipes').as_posix()}" for p in (root / "recipes").rglob("*.yaml")}
    return files


def wheel_problems(names: list[str], root: Path) -> list[str]:
    """What a wheel's file list lacks of the source tree, and what it holds outside the package."""
    missing = [f"missing {name}" for name in sorted(expected_files(root) - set(names))]
    stray = [f"outside the package: {top}" for top in sorted({name.split("/")[0] for name in names} - TOP_LEVEL)]
    return missing + stray


def _source_copy(dest: Path) -> Path:
    """The source tree without what a build or a checkout leaves (a stale build/ or egg-info would
    reach the wheel), so that the wheel is the one a clean clone builds."""

    def ignore(folder, names):
        top = Path(folder) == ROOT
        return [n for n in names if n == "__pycache__" or n.endswith(".egg-info") or top and (n[0] == "." or n in ("build", "dist", "out"))]

    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("wheel")
    source, dist = _source_copy(tmp / "src"), tmp / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(dist), str(source)]
    subprocess.run(build, check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_ships_every_package_and_recipe(wheel_names):
    assert wheel_problems(wheel_names, ROOT) == []
    assert "bagualu_plugin/sim/run.py" in wheel_names and "bagualu_plugin/recipes/bagualu/cluster/glm-188b-a20b.yaml" in wheel_names


def test_a_wheel_without_a_package_or_with_stray_folders_is_caught(wheel_names):
    """The check itself, on the wheel that broke `bagualu simulate` (no sim/) and on one that ships
    kernels/ as the top-level `kernels` the HF package owns, or the tests."""
    without_sim = [name for name in wheel_names if not name.startswith("bagualu_plugin/sim/")]
    assert "missing bagualu_plugin/sim/__init__.py" in wheel_problems(without_sim, ROOT)
    stray = wheel_problems([*wheel_names, "kernels/__init__.py", "tests/test_sim.py"], ROOT)
    assert stray == ["outside the package: kernels", "outside the package: tests"]
