"""Costs as forms of the micro-batch shape, and the comparisons that decided them (paper §IV-A's
linearity, put to work for §V-A's planner).

Every byte count and time of the cost model is linear in the load variables of one micro-batch
(`linear.Load`: tokens, routed pairs, score pairs, positions, sequences and the single-sequence
terms), or in a few functions of them: FP8 keeps one scale per started block (`math.ceil` of a
form), a copy or a cast takes its launch time below the roofline's knee (`Roofline.time` of a
form). So the code that prices a plan on numbers runs unchanged on `Sym`s: each is a linear form
over the shape's variables (the load variables, then one per such function of a form, `Sym.apply`),
carried with its value at a reference shape. Where the computation branches (a tensor under
`offload_min_bytes` stays on the device, the two largest reloads are two of several, one candidate
beats another) the branch is taken as the reference takes it and recorded on the active `Tape` as
a half-space: "this form is > 0", or ">= 0". The result holds, form for form, at every shape
inside the half-spaces recorded before it: `Tape.held` finds how far a shape follows the
reference with one product of the recorded rows and the shape's variables (`Tape.point`), so a
decision computed once is answered for any token count by evaluating forms (`Sym.at`).

Byte forms have integer coefficients over integer variables: they evaluate exactly in floating
point (below 2**53), as the computation on numbers does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import astuple, dataclass, field
from functools import cached_property, lru_cache
from types import ModuleType

import numpy as np

from .linear import LinearForm, Load

# the load variables, in `LinearForm`'s order of coefficients (its first, `const`, is the constant 1)
BASE = ("const", "tokens", "routed", "score_pairs", "positions", "sequences", "single", "single_tokens")
WIDTH = 64  # coefficients a form starts with: the load variables, and room for derived ones before any form must grow
_ACTIVE: ContextVar[Tape | None] = ContextVar("bagualu_tape", default=None)


class Sym:
    """A value linear in a `Tape`'s variables (`coef`), with its value at the tape's reference shape."""

    __slots__ = ("value", "coef")

    def __init__(self, value: float, coef: np.ndarray):
        self.value, self.coef = value, coef

    def __add__(self, other: Sym | float) -> Sym:
        if isinstance(other, Sym):
            a, b = _aligned(self.coef, other.coef)
            return Sym(self.value + other.value, a + b)
        coef = self.coef.copy()
        coef[0] += other
        return Sym(self.value + other, coef)

    __radd__ = __add__

    def __neg__(self) -> Sym:
        return Sym(-self.value, -self.coef)

    def __sub__(self, other: Sym | float) -> Sym:
        if isinstance(other, Sym):
            a, b = _aligned(self.coef, other.coef)
            return Sym(self.value - other.value, a - b)
        coef = self.coef.copy()
        coef[0] -= other
        return Sym(self.value - other, coef)

    def __rsub__(self, other: float) -> Sym:
        coef = -self.coef
        coef[0] += other
        return Sym(other - self.value, coef)

    def __mul__(self, k: float) -> Sym:
        if isinstance(k, Sym):
            raise TypeError("a product of two forms is not linear: one factor must be a number")
        return Sym(self.value * k, self.coef * k)

    __rmul__ = __mul__

    def __truediv__(self, k: float) -> Sym:
        return Sym(self.value / k, self.coef / k)

    def __ceil__(self) -> Sym:
        """This form rounded up (FP8's started blocks): a variable of the active tape (`apply`)."""
        return self.apply(np.ceil)

    def apply(self, fn: Callable[[np.ndarray], np.ndarray]) -> Sym:
        """`fn` of this form, a variable of the active tape (made on first use): its value at a
        shape is `fn` of the form's there. `fn` is pure and elementwise on arrays (the tape
        evaluates its variables of one function together); equal functions (a method of equal
        objects) make one variable of one form."""
        return _tape().derive(fn, self)

    # comparisons: decided at the reference shape, recorded on the active tape
    def __gt__(self, other: Sym | float) -> bool:
        return _decide(self - other, strict=True)

    def __ge__(self, other: Sym | float) -> bool:
        return _decide(self - other, strict=False)

    def __lt__(self, other: Sym | float) -> bool:
        return _decide(other - self, strict=True)

    def __le__(self, other: Sym | float) -> bool:
        return _decide(other - self, strict=False)

    __hash__ = object.__hash__  # one value of one computation: never equal to another by form

    @property
    def constant(self) -> bool:
        """The same at every shape."""
        return not self.coef[1:].any()

    def at(self, point: np.ndarray) -> float:
        """Its value at a shape's variables (`Tape.point`, `Tape.complete`: every variable of the form)."""
        k = min(len(self.coef), len(point))
        if self.coef[k:].any():
            raise ValueError("the shape's variables lack some of the form's: complete them (Tape.complete) first")
        return float(self.coef[:k] @ point[:k])

    def __repr__(self) -> str:
        return f"Sym({self.value!r})"


def _aligned(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two coefficient vectors over the same variables (the variables a tape made later are 0 in
    earlier forms)."""
    if len(a) == len(b):
        return a, b
    n = max(len(a), len(b))
    return np.pad(a, (0, n - len(a))), np.pad(b, (0, n - len(b)))


def _decide(d: Sym | float, strict: bool) -> bool:
    """Whether d > 0 (`strict`) or d >= 0 at the reference shape; a form that is not constant
    records the half-space its answer holds in."""
    if not isinstance(d, Sym):
        return d > 0 if strict else d >= 0
    if d.constant:
        return bool(d.coef[0] > 0 if strict else d.coef[0] >= 0)
    answer = d.value > 0 if strict else d.value >= 0
    tape = _tape()
    if answer:
        tape.record(d.coef, strict)
    else:  # not (d > 0): -d >= 0; not (d >= 0): -d > 0
        tape.record(-d.coef, not strict)
    return answer


def _tape() -> Tape:
    tape = _ACTIVE.get()
    if tape is None:
        raise RuntimeError("a symbolic cost was compared or rounded outside a Tape: enter the tape around the computation")
    return tape


class _Rows:
    """Half-spaces row . point > 0 (strict) or >= 0, in the order recorded, each once."""

    def __init__(self, width: int):
        self.matrix = np.zeros((64, width))
        self.strict = np.zeros(64, dtype=bool)
        self.count = 0
        self._keys: list[tuple[bytes, bool]] = []
        self._seen: set[tuple[bytes, bool]] = set()

    def prefix(self, n: int) -> _Rows:
        """A copy of the first `n` rows."""
        rows = _Rows(self.matrix.shape[1])
        rows.matrix, rows.strict = self.matrix[: max(n, 1)].copy(), self.strict[: max(n, 1)].copy()
        rows.count, rows._keys = n, self._keys[:n]
        rows._seen = set(rows._keys)
        return rows

    def add(self, coef: np.ndarray, strict: bool) -> None:
        key = (coef.tobytes(), strict)  # a form grown wider may come again: only its duplicate is kept
        if key in self._seen:
            return
        self._seen.add(key)
        self._keys.append(key)
        n, rows = self.count, self.matrix
        if n == len(rows) or len(coef) > rows.shape[1]:
            grown = np.zeros((2 * len(rows) if n == len(rows) else len(rows), max(rows.shape[1], len(coef))))
            grown[:n, : rows.shape[1]] = rows[:n]
            self.matrix, self.strict = grown, np.resize(self.strict, len(grown))
        self.matrix[n, : len(coef)] = coef
        self.matrix[n, len(coef) :] = 0.0
        self.strict[n] = strict
        self.count = n + 1

    def held(self, point: np.ndarray, start: int = 0) -> int:
        """How many rows hold at `point` before the first that does not (those before `start` known to)."""
        width = min(len(point), self.matrix.shape[1])
        margins = self.matrix[start : self.count, :width] @ point[:width]
        strict = self.strict[start : self.count]
        bad = np.flatnonzero(np.where(strict, margins <= 0, margins < 0))
        return self.count if len(bad) == 0 else start + int(bad[0])


class Tape:
    """The variables of one symbolic computation (the load variables, then the functions of forms
    it made, `Sym.apply`), its reference shape, and the half-spaces its branches were taken in
    (`rows`), in order. `with tape:` makes it the one `Sym` comparisons record on."""

    def __init__(self, reference: Load):
        self._derived: list[tuple[Callable, np.ndarray]] = []  # variable: fn(form . point)
        self._index: dict[tuple, int] = {}
        self._batches: list[tuple[Callable, np.ndarray, np.ndarray]] | None = []  # (fn, variables, their forms), in order
        self.rows = _Rows(WIDTH)
        self._points: dict[Load, np.ndarray] = {}
        self._reference = self.point(reference)

    def fork(self, reference: Load, rows: int) -> Tape:
        """A tape at another reference shape that holds this one's first `rows` half-spaces (they
        hold there) and its variables, numbered alike: a computation this one recorded up to
        `rows` goes on there as it went here."""
        tape = Tape.__new__(Tape)
        tape._derived, tape._index, tape._batches = list(self._derived), dict(self._index), None
        tape.rows = self.rows.prefix(rows)
        tape._points = {}
        tape._reference = tape.point(reference)
        return tape

    def __enter__(self) -> Tape:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)

    def record(self, coef: np.ndarray, strict: bool) -> None:
        self.rows.add(coef, strict)

    def held(self, point: np.ndarray, start: int = 0) -> int:
        """How many recorded half-spaces hold at `point` before the first that does not (those
        before `start` known to): a computation whose comparisons all lie in that prefix decides
        there as it did at the reference."""
        return self.rows.held(point, start)

    @property
    def recorded(self) -> int:
        return self.rows.count

    def variable(self, name: str) -> Sym:
        """The load variable `name` (one of `BASE`) as a form."""
        i = BASE.index(name)
        coef = np.zeros(WIDTH)
        coef[i] = 1.0
        return Sym(float(self._reference[i]), coef)

    def constant(self, value: float) -> Sym:
        coef = np.zeros(WIDTH)
        coef[0] = value
        return Sym(value, coef)

    def load(self, routed: Sym | float | None = None) -> FormLoad:
        """The reference shape's load as forms, with `routed` local pairs (a form, a number, or
        the `routed` variable where None)."""
        fields = [self.constant(1.0)] + [self.variable(name) for name in BASE[1:]]
        if routed is not None:
            fields[2] = routed if isinstance(routed, Sym) else self.constant(routed)
        basis = np.zeros((len(BASE), max(len(f.coef) for f in fields)))
        for i, f in enumerate(fields):
            basis[i, : len(f.coef)] = f.coef
        return FormLoad(*fields[1:], basis=basis, values=np.array([f.value for f in fields]))

    def derive(self, fn: Callable[[float], float], form: Sym) -> Sym:
        """The variable fn(`form`), made on first use."""
        key = (_same(fn), np.trim_zeros(form.coef, "b").tobytes())
        i = self._index.get(key)
        if i is None:
            i = self._index[key] = len(self._derived)
            self._derived.append((fn, form.coef.copy()))
            self._batches = None
        coef = np.zeros(max(WIDTH, len(BASE) + i + 1))
        coef[len(BASE) + i] = 1.0
        return Sym(float(fn(form.value)), coef)

    def at_reference(self, coef: np.ndarray) -> float:
        """A form's value at the reference shape."""
        if len(self._reference) < len(BASE) + len(self._derived):
            self._reference = self.complete(self._reference)
        k = min(len(coef), len(self._reference))
        return float(coef[:k] @ self._reference[:k])

    def point(self, load: Load) -> np.ndarray:
        """A shape's variables: its load's (`BASE`), then each derived variable at them (the last
        few shapes' kept: one micro-batch's decisions ask again)."""
        point = self._points.get(load)
        if point is None:
            base = [1.0, load.tokens, load.routed, load.score_pairs, load.positions, load.sequences, load.single, load.single_tokens]
            point = self._points[load] = np.array(base, dtype=float)
            while len(self._points) > 8:
                self._points.pop(next(iter(self._points)))
        point = self._points[load] = self.complete(point)
        return point

    def complete(self, point: np.ndarray) -> np.ndarray:
        """`point` with the variables the tape has made since it was taken (itself where none)."""
        n = len(BASE) + len(self._derived)
        if len(point) == n:
            return point
        known = len(point)
        point = np.concatenate([point, np.zeros(n - len(point))])
        for fn, variables, forms in self._batched():
            todo = variables >= known
            if todo.any():
                point[variables[todo]] = fn(forms[todo, :n] @ point)
        return point

    def _batched(self) -> list[tuple[Callable, np.ndarray, np.ndarray]]:
        """The derived variables by depth (each after those its form reads) and function: one
        product and one call of the function per batch."""
        if self._batches is None:
            n, depth = len(BASE) + len(self._derived), []
            groups: dict[tuple[int, Callable], list[int]] = {}
            for i, (fn, form) in enumerate(self._derived):
                reads = np.flatnonzero(form[len(BASE) :])
                depth.append(1 + max((depth[j] for j in reads), default=0))
                groups.setdefault((depth[i], _same(fn)), []).append(i)
            self._batches = []
            for (_, _), members in sorted(groups.items(), key=lambda group: group[0][0]):
                fn = self._derived[members[0]][0]
                forms = np.zeros((len(members), n))
                for row, i in enumerate(members):
                    form = self._derived[i][1][:n]
                    forms[row, : len(form)] = form
                self._batches.append((fn, np.array(members) + len(BASE), forms))
        return self._batches


def total(values: list[Sym | float]) -> Sym | float:
    """The sum of numbers, or of forms (in one product, not one operation per term)."""
    forms = [v for v in values if isinstance(v, Sym)]
    if not forms:
        return sum(values, 0.0)
    numbers = sum((v for v in values if not isinstance(v, Sym)), 0.0)
    width = max(len(f.coef) for f in forms)
    if all(len(f.coef) == width for f in forms):
        coef = np.add.reduce([f.coef for f in forms])
    else:
        coef = np.zeros(width)
        for f in forms:
            coef[: len(f.coef)] += f.coef
    coef = coef.copy() if len(forms) == 1 else coef
    coef[0] += numbers
    return Sym(sum(f.value for f in forms) + numbers, coef)


def upper(values: list[Sym | float]) -> Sym | float:
    """A value no smaller than any of `values` at any shape, without a comparison: each variable's
    largest coefficient among them (every variable is non-negative; a number has none)."""
    if not any(isinstance(v, Sym) for v in values):
        return max(values)
    width = max(len(v.coef) for v in values if isinstance(v, Sym))
    coef = np.full(width, -np.inf)
    for v in values:
        if isinstance(v, Sym):
            coef[: len(v.coef)] = np.maximum(coef[: len(v.coef)], v.coef)
            coef[len(v.coef) :] = np.maximum(coef[len(v.coef) :], 0.0)
        else:
            coef[0], coef[1:] = max(coef[0], v), np.maximum(coef[1:], 0.0)
    return Sym(_tape().at_reference(coef), coef)


def _same(fn: Callable) -> object:
    """What makes two functions one: a method of equal objects (`Roofline.times` of equal
    rooflines) is one function, though bound methods compare their objects by identity."""
    self = getattr(fn, "__self__", None)
    return fn if self is None or isinstance(self, ModuleType) else (fn.__func__, self)


@lru_cache(maxsize=4096)
def _coefficients(form: LinearForm) -> np.ndarray:
    return np.array(astuple(form), dtype=float)


@dataclass(frozen=True, eq=False)
class FormLoad(Load):
    """A load whose variables are forms (`Tape.load`): `LinearForm.at` hands itself to `at`, which
    makes the form in one product rather than one operation per coefficient."""

    basis: np.ndarray = field(default=None, repr=False)  # its variables' coefficients, one row each, `const` first
    values: np.ndarray = field(default=None, repr=False)  # their values at the reference

    __hash__ = object.__hash__  # one shape's loads of one tape: the footprints' memo keys on it

    def __eq__(self, other: object) -> bool:
        return self is other

    def at(self, form: LinearForm) -> Sym:
        made = self._made.get(form)
        if made is None:
            k = _coefficients(form)
            made = self._made[form] = Sym(float(k @ self.values), k @ self.basis)
        return made

    @cached_property
    def _made(self) -> dict[LinearForm, Sym]:
        """The forms made at this load (every block of a kind asks for the same ones)."""
        return {}

    @cached_property
    def memo(self) -> dict:
        """The footprints and prices computed at this load (`costmodel.mitigation.memoised`): they go with it."""
        return {}
