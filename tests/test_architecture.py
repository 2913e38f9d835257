"""Guardrails of the layering (docs/architecture.md): the pure half imports no torch, and family
differences live in the traits table only."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from bagualu_plugin.families import FAMILIES

PACKAGE = Path(__file__).resolve().parents[1] / "bagualu_plugin"
PURE = ("costmodel", "planner", "sim")

# Imports every module of the pure packages with torch and transformers unimportable. The package
# itself is stood in for by an empty module, so that bagualu_plugin/__init__.py (the public API,
# which needs torch) does not run; what the pure modules import from the package still loads.
_IMPORT_PURE = """
import importlib, pkgutil, sys, types
for name in ("torch", "transformers"):
    sys.modules[name] = None  # any import of it, or of a submodule, raises ImportError
package = types.ModuleType("bagualu_plugin")
package.__path__ = [{path!r}]
sys.modules["bagualu_plugin"] = package
for sub in {pure!r}:
    importlib.import_module("bagualu_plugin." + sub)
    for module in pkgutil.walk_packages([{path!r} + "/" + sub], "bagualu_plugin." + sub + "."):
        importlib.import_module(module.name)
print(sorted(m for m in sys.modules if m.startswith("bagualu_plugin.")))
"""


def _import_pure(path: Path, pure: tuple[str, ...] = PURE) -> subprocess.CompletedProcess:
    code = _IMPORT_PURE.format(path=str(path), pure=pure)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.multiprocess
def test_costmodel_planner_and_sim_import_without_torch():
    done = _import_pure(PACKAGE)
    assert done.returncode == 0, done.stderr
    for module in ("costmodel.model", "planner.greedy", "sim.run", "sim.systems"):
        assert f"bagualu_plugin.{module}" in done.stdout


@pytest.mark.multiprocess
def test_the_purity_check_catches_a_torch_import(tmp_path):
    """The check above fails as soon as a pure module imports torch (here: a copy of the package
    with one such line added)."""
    copy = tmp_path / "bagualu_plugin"
    for source in PACKAGE.rglob("*.py"):
        target = copy / source.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.read_text())
    linear = copy / "costmodel" / "linear.py"
    linear.write_text(linear.read_text().replace("from dataclasses import", "import torch\nfrom dataclasses import", 1))
    done = _import_pure(copy)
    assert done.returncode != 0 and "torch" in done.stderr


def _family_compares(tree: ast.AST) -> list[int]:
    """Lines comparing anything with a family name (`x == "gpt_oss"`, `x in ("glm4_moe", ...)`)."""
    def names(node):
        if isinstance(node, ast.Constant):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in node.elts if isinstance(e, ast.Constant)}
        return set()

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(names(side) & set(FAMILIES) for side in (node.left, *node.comparators))
    ]


def test_no_family_name_compares_outside_the_traits_table():
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := _family_compares(ast.parse(path.read_text())))
    }
    assert found == {}, "read a trait from bagualu_plugin/families.py instead"


def test_family_compare_check_finds_one():
    assert _family_compares(ast.parse('if d.family in ("glm4_moe", "x") or f == "mixtral": pass')) == [1, 1]


# The configuration layer (docs/architecture.md, "Layers"): the recipe and what it is made of. The
# recipe holds the model's dimensions as `costmodel.dims.ModelDims`, which itself imports only this
# layer; nothing else above it may load with the recipe (loading `costmodel.dims` runs the pure
# `costmodel` package's __init__, hence that package among what loads).
CONFIGURATION = ("config", "units", "validation", "hardware", "families")


def _package_imports(source: str, level: int = 1) -> set[str]:
    """The package's modules one module's source imports (`from .x.y import z` -> "x.y"), at `level`
    dots: 1 for a top-level module, 2 for one in a subpackage."""
    return {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.level == level and node.module
    }


@pytest.mark.multiprocess
def test_the_recipe_imports_nothing_above_it():
    assert _package_imports((PACKAGE / "config.py").read_text()) <= {*CONFIGURATION, "costmodel.dims"}
    assert _package_imports((PACKAGE / "costmodel" / "dims.py").read_text(), level=2) <= set(CONFIGURATION)
    done = _import_pure(PACKAGE, ("config",))  # and without torch
    assert done.returncode == 0, done.stderr
    loaded = {m.split(".")[1] for m in ast.literal_eval(done.stdout)}
    assert "config" in loaded and loaded <= {*CONFIGURATION, "costmodel"}


def test_the_layer_check_finds_a_planner_import():
    assert "planner.dual_batch" in _package_imports("from .planner.dual_batch import check_pipeline\n")
