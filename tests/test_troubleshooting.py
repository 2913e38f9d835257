"""docs/troubleshooting.md lists every error the plugin raises, with what it means and what to do;
this keeps it complete. It reads the package's source with `ast` (nothing is imported) and finds
every message a user can meet:

- what a `raise` raises: the strings given to the exception, the messages of a function that
  makes the exception (`raise _infeasible(...)`), and of a list of problems joined into one;
- each `(field, message)` problem given to `reject` (pydantic validators of the recipe) or to
  `RecipeError` (the field is the tuple's first item, the message its last);
- `warnings.warn` messages.

A message held in a variable is followed to what the enclosing function assigns or appends to it.
Each message's longest literal fragment (its fixed text between placeholders, whitespace
normalised) must appear in the page. The one exemption is a rule, not a list: a message whose
fixed text is shorter than `MIN_FRAGMENT` characters (a bare `raise`, a re-raise of `str(exc)`,
a field name such as `DataError("path", ...)`'s first argument) has nothing to look up; internal
consistency errors are documented too (the page says to report them), so there is no allow-list.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bagualu_plugin"
PAGE = ROOT / "docs" / "troubleshooting.md"
MIN_FRAGMENT = 12  # shorter fixed text identifies nothing ("unknown key", "FSDP: ")
MAX_EXEMPT = 40  # sites without such text (28 when this was written): more means messages the collector lost track of


@dataclass(frozen=True)
class Message:
    path: str  # relative to the repository root
    line: int
    fragment: str  # the longest literal fragment, whitespace normalised ("" if none)


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _literal_parts(node: ast.expr) -> list[str] | None:
    """The fixed text of a string expression (a constant, an f-string's constant parts, a `+` of
    such), split where a value is formatted in; None if `node` is no string expression."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        parts, current = [], ""
        for value in node.values:
            if isinstance(value, ast.Constant):
                current += value.value
            else:
                parts.append(current)
                current = ""
        return [*parts, current]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_parts(node.left), _literal_parts(node.right)
        if left is None and right is None:
            return None
        return [*(left or [""]), *(right or [""])]  # a non-string operand splits the text
    return None


def _fragment(node: ast.expr) -> str:
    """The longest literal fragment of a string expression, whitespace normalised."""
    return max((_normalise(p) for p in _literal_parts(node) or []), key=len, default="")


def _holes(node: ast.expr) -> list[ast.expr]:
    """The values formatted into a string expression: f-string fields, non-string `+` operands."""
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.FormattedValue)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [side for side in (node.left, node.right) if _literal_parts(side) is None] + _holes(node.left) + _holes(node.right)
    return []


class _Module:
    def __init__(self, path: Path, functions: dict[str, list[ast.FunctionDef]], classes: dict[str, list[ast.ClassDef]]):
        self.rel = path.relative_to(ROOT).as_posix()
        self.tree = ast.parse(path.read_text(), str(path))
        self.functions, self.classes = functions, classes
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(self.tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent

    def scope(self, node: ast.AST) -> ast.AST:
        """The function (or module) whose locals `node`'s names are."""
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return self.tree


def _bindings(scope: ast.AST, name: str) -> list[ast.expr]:
    """What `scope` assigns to `name` or puts in it: `name = x`, `name += x`, `name.append(x)`,
    `name.extend(x)` (nested functions' bodies excluded, their locals are their own)."""
    found = []
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found.append(node.value)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and any(_binds(t, name) for t in node.targets):
            found.append(node.value)  # `preset, unknown = preset_for(...)`: the call, whose returns are followed
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name) and node.target.id == name:
            if node.value is not None:
                found.append(node.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == name
        ):
            found.extend(node.args)
    return found


def _binds(target: ast.expr, name: str) -> bool:
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_binds(t, name) for t in target.elts)
    return isinstance(target, ast.Name) and target.id == name


def _messages(module: _Module, node: ast.expr, scope: ast.AST, seen: set, top: bool = False, table: bool = False) -> list[ast.expr]:
    """The string expressions a raised, rejected or warned value `node` is made of. A call's
    arguments count only for the raised call itself (`top`) and for a class (an exception made
    elsewhere), not for a helper's (`getattr(state, "distributed_type", ...)`). A module-level
    constant counts only as what a comprehension runs over (`table`: a table of messages such as
    `_REFUSED`), not where it is a value formatted in (`{COEFFICIENTS}`) or an error's kind."""
    key = (id(node), id(scope))
    if key in seen:
        return []
    seen.add(key)
    if _literal_parts(node) is not None:
        found = [node]
        for hole in _holes(node):
            if isinstance(hole, (ast.Name, ast.Call, ast.IfExp)):  # `f"{msg} (...)"`, `"FSDP: " + "; ".join(refused)`
                found += _messages(module, hole, scope, seen)
        return found
    if isinstance(node, ast.Tuple) and node.elts:  # (field, message), (bad, field, message)
        return _messages(module, node.elts[-1], scope, seen)
    if isinstance(node, (ast.List, ast.Set)):
        return [m for elt in node.elts for m in _messages(module, elt, scope, seen)]
    if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
        # `[(path, msg) for bad, path, msg in checks if bad]`, `[f"{name}: {why}" for name, why in _REFUSED.items()]`:
        # where the element has no text of its own, the text is in what the comprehension runs over
        found = _messages(module, node.elt, scope, seen)
        if all(len(_fragment(m)) < MIN_FRAGMENT for m in found):
            found += [m for gen in node.generators for m in _messages(module, gen.iter, scope, seen, table=True)]
        return found
    if isinstance(node, ast.Dict):
        return [m for value in node.values for m in _messages(module, value, scope, seen)]
    if isinstance(node, ast.IfExp):
        return _messages(module, node.body, scope, seen) + _messages(module, node.orelse, scope, seen)
    if isinstance(node, ast.Starred):
        return _messages(module, node.value, scope, seen)
    if isinstance(node, ast.Name):  # a local, else a module-level constant
        for where in (scope, module.tree) if table else (scope,):
            values = _bindings(where, node.id)
            if values:
                return [m for value in values for m in _messages(module, value, where, seen)]
        return []
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "join":  # "; ".join(problems)
            return [m for arg in node.args for m in _messages(module, arg, scope, seen)]
        if isinstance(func, ast.Attribute) and func.attr in ("items", "values"):  # for names, why in _REFUSED.items()
            return _messages(module, func.value, scope, seen, table=table)
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        found = []
        if top or name[:1].isupper():  # the raised call, or an exception made elsewhere: its arguments are the message
            found = [m for arg in [*node.args, *(k.value for k in node.keywords)] for m in _messages(module, arg, scope, seen)]
        for function in module.functions.get(name, []):  # `raise _infeasible(...)`: what it returns
            for ret in ast.walk(function):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    found += _messages(function.module, ret.value, function, seen)  # type: ignore[attr-defined]
        for cls in module.classes.get(name, []):  # an error that words its own message in __init__
            for init in cls.body:
                if isinstance(init, ast.FunctionDef) and init.name == "__init__":
                    for call in ast.walk(init):
                        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "__init__":
                            found += [m for arg in call.args for m in _messages(cls.module, arg, init, seen)]  # type: ignore[attr-defined]
        return found
    return []


def _sites(module: _Module) -> list[ast.expr]:
    """Every value the module raises, gives `reject`, or warns with."""
    values = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            values.append(node.exc)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name == "reject" or (name == "warn" and isinstance(func, ast.Attribute) and getattr(func.value, "id", None) == "warnings"):
                values.extend(node.args[:1])
    return values


@cache
def collect() -> tuple[list[Message], list[Message]]:
    """Every message of the package (deduplicated by place and text), and the sites (raise,
    `reject`, `warnings.warn`; fragment: the longest of their messages') that have no fixed text
    of `MIN_FRAGMENT` characters: exempt."""
    paths = sorted(PACKAGE.rglob("*.py"))
    functions: dict[str, list[ast.FunctionDef]] = {}
    classes: dict[str, list[ast.ClassDef]] = {}
    modules = [_Module(path, functions, classes) for path in paths]
    for module in modules:  # module-level functions and classes, by name, for a raise that calls one
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef):
                node.module = module  # type: ignore[attr-defined]
                functions.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ClassDef):
                node.module = module  # type: ignore[attr-defined]
                classes.setdefault(node.name, []).append(node)
    messages, exempt = {}, []
    for module in modules:
        for value in _sites(module):
            found = []
            for expr in _messages(module, value, module.scope(value), set(), top=True):
                found.append(Message(_owner(modules, expr).rel, expr.lineno, _fragment(expr)))
            messages.update(dict.fromkeys(found))
            if all(len(m.fragment) < MIN_FRAGMENT for m in found):
                exempt.append(Message(module.rel, value.lineno, max((m.fragment for m in found), key=len, default="")))
    return list(messages), exempt


def _owner(modules: list[_Module], expr: ast.expr) -> _Module:
    return next(m for m in modules if expr in m.parents)


def undocumented(messages: list[Message], page: str) -> list[Message]:
    text = _normalise(page)
    return [m for m in messages if len(m.fragment) >= MIN_FRAGMENT and m.fragment not in text]


def test_every_error_is_in_the_troubleshooting_page():
    messages, exempt = collect()
    assert len(messages) > 200  # the collector still finds the package's errors
    listing = "\n".join(f"{m.path}:{m.line}: {m.fragment}" for m in exempt)
    assert len(exempt) <= MAX_EXEMPT, (
        f"{len(exempt)} raise/reject/warn sites have no fixed text of {MIN_FRAGMENT} characters the test can follow; "
        f"give a new error's message as a string at the raise (or in a variable of the same function):\n{listing}"
    )
    missing = undocumented(messages, PAGE.read_text())
    listing = "\n".join(f"{m.path}:{m.line}: {m.fragment}" for m in sorted(missing, key=lambda m: (m.path, m.line)))
    assert not missing, f"{len(missing)} messages are not in {PAGE.relative_to(ROOT)}:\n{listing}"


def test_the_check_fails_without_the_entry():
    """The lookup is by fixed text: a page without a message's fragment fails that message."""
    messages, _ = collect()
    page = _normalise(PAGE.read_text())
    first = next(m for m in messages if len(m.fragment) >= MIN_FRAGMENT and m.fragment in page)
    assert first in undocumented(messages, page.replace(first.fragment, ""))
