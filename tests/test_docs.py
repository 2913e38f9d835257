"""The documentation: the MkDocs site builds strictly, and the code it shows is the package's.

Guides show the tested examples (`examples/*.py`) by including the files (`--8<--`), so what they
show is what CI runs. The short inline `python` blocks of `docs/**/*.md` and `README.md` are
checked twice. Statically: each parses, and every name it takes from `bagualu_plugin` (an import, a
`bgl.` attribute, a method of an imported class, a keyword argument of a package function or
class) exists there, read as griffe reads it for the API pages, so a renamed function, a removed
keyword or a typo names its block. And by running it as written, on CPU, given what its text takes
as given (a tiny checkpoint saved where it loads one, a model, its batches): the README's two loops
and every guide's inline example, but the one that needs 4 processes, which says why.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "bagualu_plugin"
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
INCLUDE = re.compile(r"""--8<--\s+["']([^"':]+)""")


def _blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for m in FENCE.finditer(path.read_text()):
            out.append((f"{path.relative_to(ROOT)}:{path.read_text()[:m.start()].count(chr(10)) + 1}", textwrap.dedent(m["body"])))
    return out


BLOCKS = _blocks()


# -- the package, read statically ------------------------------------------------------------------

def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@cache
def _tree(module: str) -> ast.Module | None:
    path = _module_file(module)
    return ast.parse(path.read_text()) if path else None


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    is_package = _module_file(module).name == "__init__.py"
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(module: str, name: str, seen: frozenset = frozenset()):
    """What `module.name` is: ("module", dotted), ("def", FunctionDef), ("class", (module, ClassDef)),
    ("value", None) for anything else defined there, or None where the package does not define it."""
    if (module, name) in seen:
        return None
    seen |= {(module, name)}
    tree = _tree(module)
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ("class", (module, node))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ("def", node)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _absolute(module, node)
                    if not source.startswith(PACKAGE):
                        return ("value", None)  # re-exported from another library
                    if _module_file(f"{source}.{alias.name}"):
                        return ("module", f"{source}.{alias.name}")
                    return _resolve(source, alias.name, seen)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return ("value", None)
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            targets = [node.target]
        if any(t.id == name for t in targets):
            return ("value", None)
    if _module_file(f"{module}.{name}"):
        return ("module", f"{module}.{name}")
    return None


def _member(owner, name: str):
    """A class's member, looked up in its body and in its bases within the package; "unknown"
    where a base lies outside it (inherited from pydantic, torch, transformers...)."""
    module, cls = owner
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ("def", node)
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ("class", (module, node))
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return ("value", None)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ("value", None)
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            return "unknown"
        found = _resolve(module, base.id)
        if not found or found[0] != "class":
            return "unknown"
        inherited = _member(found[1], name)
        if inherited:
            return inherited
    return None


def _parameters(target) -> set[str] | None:
    """The keyword names a call of `target` accepts; None where any is accepted (or unknown)."""
    kind, node = target
    if kind == "def":
        args = node.args
        if args.kwarg:
            return None
        return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    if kind == "class":
        init = _member(node, "__init__")
        if init == "unknown" or (init is None and node[1].bases):
            return None
        if init:
            return _parameters(init)
        return {n.target.id for n in node[1].body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return None


# -- a block's uses of the package -------------------------------------------------------------------

def _problems(code: str) -> list[str]:
    tree = ast.parse(code)
    bound: dict[str, tuple] = {}  # local name -> what it is in the package
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    if not _module_file(alias.name):
                        problems.append(f"no module {alias.name}")
                    bound[alias.asname or alias.name.split(".")[0]] = ("module", alias.name if alias.asname else PACKAGE)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE:
            if not _module_file(node.module):
                problems.append(f"no module {node.module}")
                continue
            for alias in node.names:
                found = _resolve(node.module, alias.name)
                if found is None:
                    problems.append(f"{node.module} has no {alias.name}")
                else:
                    bound[alias.asname or alias.name] = found

    def lookup(expr):
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = lookup(expr.value)
            if owner is None or owner == "unknown":
                return owner
            if owner[0] == "module":
                found = _resolve(owner[1], expr.attr)
                if found is None:
                    problems.append(f"{owner[1]} has no {expr.attr}")
                    return "unknown"
                return found
            if owner[0] == "class":
                found = _member(owner[1], expr.attr)
                if found is None:
                    problems.append(f"{owner[1][1].name} has no {expr.attr}")
                    return "unknown"
                return found
            return "unknown"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            lookup(node)
        if isinstance(node, ast.Call):
            target = lookup(node.func)
            if target and target != "unknown":
                accepted = _parameters(target)
                for kw in node.keywords:
                    if kw.arg and accepted is not None and kw.arg not in accepted:
                        problems.append(f"{ast.unparse(node.func)}() takes no keyword {kw.arg!r}")
    return sorted(set(problems))


@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_python_block_uses_the_package_as_it_is(where, code):
    for path in INCLUDE.findall(code):
        assert (ROOT / path).is_file(), f"{where}: includes {path}, which does not exist"
    if INCLUDE.search(code):
        return
    try:
        problems = _problems(code)
    except SyntaxError as exc:
        pytest.fail(f"{where}: not Python: {exc}")
    assert not problems, f"{where}: " + "; ".join(problems)


def test_the_check_catches_what_it_is_for():
    assert _problems("import bagualu_plugin as bgl\nbgl.apply(model, recipe, cost=None)") == []
    assert _problems("import bagualu_plugin as bgl\nbgl.aply(model)") == ["bagualu_plugin has no aply"]
    assert _problems("import bagualu_plugin as bgl\nbgl.apply(model, costs=None)") == ["bgl.apply() takes no keyword 'costs'"]
    assert _problems("from bagualu_plugin.integrations.transformers import BagualuCallbak") == [
        "bagualu_plugin.integrations.transformers has no BagualuCallbak"
    ]
    assert _problems("import bagualu_plugin as bgl\nbgl.CostModel.from_confg(1)") == ["CostModel has no from_confg"]
    assert len(BLOCKS) >= 10


def test_readme_and_ci_agree():
    """The README's test command is the one `.ci/run` runs, and its headline table is the benchmarks page's."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"```bash\n(python3 -m venv .venv .*ruff check .*)\n```", readme)[1]
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    for row in (ROOT / "docs" / "benchmarks" / "headline.md").read_text().splitlines():
        assert row in readme, f"docs/benchmarks/headline.md row missing from README.md: {row}"
    for link in re.findall(r"\]\(((?:docs/)?[^)#:]+)(?:#[^)]*)?\)", readme):
        assert (ROOT / link).exists(), f"README.md links to {link}, which is not in the repository"


@pytest.fixture
def cpu_bf16(monkeypatch):
    """SFTConfig's default bf16=True asks for a GPU that computes in bf16 unless use_cpu is set: the
    examples leave it at the default a GPU user runs, and here the CPU's bf16 autocast runs them."""
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)


@pytest.mark.filterwarnings("error:bagualu:RuntimeWarning")  # no op keeps other bytes than its cost model says
def test_the_readmes_examples_run_as_written(tmp_path, cpu_bf16):
    """The README's two loops, verbatim, on CPU: TRL's SFTTrainer with LoRA and the callback on a
    tiny checkpoint saved as `ckpt` beside a `corpus.txt` (the working directory is the test's
    own), and `bgl.apply` around a plain loop given its `model`, `batches` and `optimizer`."""
    import torch

    from bagualu_plugin.adapters.tiny import save_tiny, tiny_model, tiny_tokenizer

    trainer_example, loop_example = [m["body"] for m in FENCE.finditer((ROOT / "README.md").read_text())]
    save_tiny("qwen3_moe", tmp_path / "ckpt")
    tiny_tokenizer().save_pretrained(tmp_path / "ckpt")
    (tmp_path / "corpus.txt").write_text("\n".join(f"document {i}: " + "tokens of a short text " * (1 + i % 5) for i in range(16)))
    done: dict = {}
    exec(compile(trainer_example, "README.md", "exec"), done)
    assert done["callback"].provisioner.forwards > 0 and (tmp_path / "out" / "bagualu-telemetry.jsonl").read_text()
    assert {e.kind["autocast"] for e in done["callback"].provisioner.events} == {"bf16"}  # mixed precision over the FP32 checkpoint
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").train()
    batches = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 128, (2, 16)) for _ in range(3))]
    done = {"model": model, "batches": batches, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    exec(compile(loop_example, "README.md", "exec"), done)
    assert len(done["prov"].events) == len(batches) and (tmp_path / "bagualu-telemetry.jsonl").read_text()
    done["prov"].remove()


def _checkpoint(where: Path, family: str = "qwen3_moe", **config) -> None:
    from bagualu_plugin.adapters.tiny import save_tiny, tiny_tokenizer

    save_tiny(family, where, **config)
    tiny_tokenizer().save_pretrained(where)


def _corpus(where: Path) -> None:
    where.write_text("\n".join(f"document {i}: " + "tokens of a short text " * (1 + i % 5) for i in range(16)))


def _loop(tmp_path: Path) -> dict:
    """What a plain loop's example takes as given: a model in training, its micro-batches, an optimizer."""
    import torch

    from bagualu_plugin.adapters.tiny import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").train()
    ids = [torch.randint(0, 128, (2, 16)) for _ in range(3)]  # each its own storage, as a data loader's
    return {"model": model, "ids": ids[0], "batches": [{"input_ids": i, "labels": i} for i in ids],
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def _accelerate(tmp_path: Path) -> dict:
    from accelerate import Accelerator

    given = _loop(tmp_path)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    return {**given, "batches": [b["input_ids"] for b in given["batches"]], "accelerator": accelerator}


def _pipeline(tmp_path: Path) -> dict:
    """A recipe file for the model (one stage, 3 micro-batches of 2 x 16 tokens) and two iterations of data."""
    import torch
    import yaml
    from helpers import tiny_recipe

    given = _loop(tmp_path)
    recipe = tiny_recipe(given["model"], seq_len=16, micro_batch_size=2, capacity=4, pipeline={"pp": 1, "micro_batches": 3}, as_dict=True)
    (tmp_path / "my-recipe.yaml").write_text(yaml.safe_dump(recipe))
    return {"model": given["model"], "data": [[torch.randint(0, 128, (2, 16)) for _ in range(3)] for _ in range(2)]}


def _trainer(tmp_path: Path) -> dict:
    _checkpoint(tmp_path / "ckpt")
    _corpus(tmp_path / "corpus.txt")
    return {}


def _profiled(tmp_path: Path) -> dict:
    _checkpoint(tmp_path / "tiny-qwen3", num_hidden_layers=3)  # its layers 1 and 2 are MoE: two routed counts
    return {}


def _fixed_plan(tmp_path: Path) -> dict:
    from bagualu_plugin.adapters.tiny import tiny_model

    return {**_loop(tmp_path), "model": tiny_model("qwen3_moe", num_hidden_layers=3).train()}


# Every inline `python` block of the docs, by (page, its n-th inline block): what it takes as given
# (the working directory is the test's own), or why it cannot run in one CPU process.
INLINE = {
    ("docs/concepts/cost-model.md", 0): lambda tmp: {"model": _loop(tmp)["model"]},
    ("docs/guides/accelerate.md", 0): _accelerate,
    ("docs/guides/adaptive-loop.md", 0): _loop,
    ("docs/guides/adaptive-loop.md", 1): _pipeline,
    ("docs/guides/fixed-plans.md", 0): _fixed_plan,
    ("docs/guides/profiling.md", 0): _profiled,
    ("docs/guides/trainer.md", 0): _trainer,
    ("docs/guides/expert-parallelism.md", 0): "4 processes under torchrun: tests/test_expert_parallel.py runs its calls over gloo",
}


def _inline(page: str) -> list[str]:
    return [m["body"] for m in FENCE.finditer((ROOT / page).read_text()) if not INCLUDE.search(m["body"])]


def test_every_inline_block_of_the_docs_is_run_or_says_why_not():
    pages = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md"))]
    found = {(page, n) for page in pages for n, _ in enumerate(_inline(page))}
    assert found == set(INLINE)


@pytest.mark.filterwarnings("error:bagualu:RuntimeWarning")
@pytest.mark.parametrize("page, n", [key for key, given in INLINE.items() if callable(given)], ids=lambda v: str(v))
def test_an_inline_example_of_the_docs_runs_as_written(page, n, tmp_path, cpu_bf16):
    """Each guide's inline example, verbatim, on CPU, given what its text says it takes."""
    done = INLINE[(page, n)](tmp_path)
    exec(compile(_inline(page)[n], page, "exec"), done)
    assert "prov" not in done or done["prov"].forwards > 0  # a loop's micro-batches were provisioned


@pytest.mark.multiprocess
def test_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip('the docs extra is not installed (pip install -e ".[docs]")')
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "DISABLE_MKDOCS_2_WARNING": "true"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
