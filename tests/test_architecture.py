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


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """The package's modules and the package modules each imports, wherever in it (a function's
    lazy import and a `TYPE_CHECKING` block included): `from . import x` of a submodule is an
    edge to that submodule, `from .x import y` to `x` (and to `x.y` where that is a module)."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else []
                target = ".".join(base + [node.module]) if node.module else ".".join(base)
                subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                edges |= subs if node.module is None and len(subs) == len(node.names) else subs | ({target} & modules.keys())
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names} & modules.keys()
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_one(tmp_path):
    package = tmp_path / "bagualu_plugin"
    (package / "runtime").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "runtime" / "__init__.py").write_text("")
    (package / "runtime" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (package / "runtime" / "b.py").write_text("def f():\n    from . import a\n")
    assert cycles(import_graph(package)) == [["bagualu_plugin.runtime.a", "bagualu_plugin.runtime.b"]]


def private_reads(root: Path = PACKAGE, where: str = "runtime") -> list[str]:
    """Reads of another class's private attribute in `where`'s modules: `other._name` where
    `_name` is an attribute or method one of the package's classes defines (as `self._name`, a
    method, or a class-level name), read outside those classes. Names the tensor, module and
    storage classes of torch define too (`tensor._version`) are theirs."""
    import torch

    defined: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names = [node.name]
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names = [node.attr]
                elif isinstance(node, ast.Assign) and node in cls.body:
                    names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                else:
                    continue
                for name in names:
                    if name.startswith("_") and not name.startswith("__"):
                        defined.setdefault(name, set()).add(cls.name)
    theirs = (torch.Tensor, torch.nn.Module, torch.UntypedStorage)
    found = []
    for path in sorted((root / where).glob("*.py")):
        tree = ast.parse(path.read_text())
        classes = {}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                classes.setdefault(node, cls.name)  # the innermost class is met last: outer ones first
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in defined) or any(hasattr(t, node.attr) for t in theirs):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if classes.get(node) not in defined[node.attr]:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_runtime_object_reads_another_class_private_attributes():
    assert private_reads() == []


def test_the_private_read_check_finds_one(tmp_path):
    package = tmp_path / "bagualu_plugin"
    (package / "runtime").mkdir(parents=True)
    (package / "runtime" / "prov.py").write_text("class Prov:\n    def __init__(self):\n        self._forward = None\n")
    (package / "runtime" / "bounds.py").write_text(
        "class Bounds:\n    def before(self, prov):\n        return prov._forward, self._depth, tensor._version\n"
    )
    assert private_reads(package) == ["bounds.py:3: prov._forward"]
