"""The wheel as a package index ships it: every package of the source tree and the recipes' YAML
(recipes/, linked into the package), nothing else at the top level. An editable install imports the
source folders, which once hid a wheel without bagualu_plugin.sim. And no folder of the repository
shadows an installed package for a process started at its root: a `kernels/` package there once
took the place of HF's `kernels`, which transformers >= 5.25 imports, in every such process."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = {"bagualu_plugin", "bagualu_plugin-0.1.0.dist-info"}

pytestmark = pytest.mark.multiprocess  # every test reads the wheel `pip wheel` builds in a subprocess


def expected_files(root: Path) -> set[str]:
    """Wheel paths of every module of every package (a folder with an __init__.py) under
    bagualu_plugin/, and of every recipe YAML (the repository's recipes/, shipped as bagualu_plugin/recipes/)."""
    files = set()
    for init in (root / "bagualu_plugin").rglob("__init__.py"):
        files |= {p.relative_to(root).as_posix() for p in init.parent.glob("*.py")}
    return files | {f"bagualu_plugin/{p.relative_to(root).as_posix()}" for p in (root / "recipes").rglob("*.yaml")}


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


def test_no_folder_at_the_root_is_a_package_but_the_plugin():
    """A regular package at the repository root is imported, under its folder's name, by every
    process whose sys.path starts with the working directory (python -c, multiprocessing's
    forkserver, pytest-xdist's workers), ahead of an installed package of that name."""
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert packages == ["bagualu_plugin"]
    assert (ROOT / "bagualu_plugin" / "recipes").resolve() == ROOT / "recipes"


def test_transformers_and_the_plugin_import_at_the_repository_root():
    """transformers' activations import HF's `kernels` where it is installed (transformers >= 5.25
    depends on it). Started at the repository root, `python -c` and a rank of `run_ranks` (whose
    forkserver imports the plugin, transformers with it) must find HF's, never a folder of ours."""
    code = (
        "import importlib.util, sys, transformers.activations, bagualu_plugin\n"
        "from bagualu_plugin.parallel.launch import run_ranks\n"
        "sys.path.append('tests')\n"  # after '', the working directory, which stays first
        "from helpers import origin_of\n"
        "print(importlib.util.find_spec('kernels').origin, *run_ranks(origin_of, 1, 'kernels', timeout_s=60))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    here, in_rank = done.stdout.split()
    assert here == in_rank and "site-packages" in here and not here.startswith(str(ROOT / "kernels")), done.stdout


def test_installing_leaves_the_installed_torch_in_place(tmp_path):
    """`pip install .` where a supported torch is installed already (a GPU machine's CUDA build; in
    CI each version set's own) installs the plugin alone: nothing replaces torch, nor any other
    installed dependency. Offline, as on an air-gapped machine: every requirement is met in place."""
    import json

    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "-q", "--report", str(report),
               str(_source_copy(tmp_path / "src"))]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["bagualu-plugin"], installs
