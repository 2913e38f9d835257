"""Algorithm 2 of paper §V-A for every budget and every micro-batch shape, from a few paths.

Algorithm 2's next candidate depends only on the plan so far, and the need
(`Footprint.needed_bytes`) never grows along its plans: the budget only decides where it stops.
The path depends on the shape only through the comparisons the greedy makes, each the sign of a
form linear in the shape's variables (`costmodel.symbolic`). So a path computed once on forms,
each comparison recorded, is every shape's path as far as that shape satisfies those
comparisons. `PathPlanner` keeps a few such paths (its first computed whole at once, which the
run's first micro-batch pays for; the others, forked from it, only as far as the budgets asked
need), and answers a budget for a shape from the first path whose comparisons the shape satisfies
up to the first plan that fits: the shape enters once, in one product with the comparisons and
one with the plans' needs. A shape that leaves every kept path before its plan is found starts
one of its own, the least recently used giving way. The answer is exactly `plan_micro_batch`'s
from scratch at the same rounded budget and routing: the same plan and bytes (byte forms have
integer coefficients: exact); its times from their forms where the shape follows the times'
branches too, else priced at the shape (`CostModel.footprint`), the same to floating-point
rounding either way.

A routing that differs between MoE layers (an oracle's, known per layer) is answered from one
path on numbers per routing instead, kept likewise.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np

from ..costmodel.forward import Forward
from ..costmodel.linear import Load
from ..costmodel.mitigation import MITIGATIONS, Footprint, MitigationOptions
from ..costmodel.model import CostModel
from ..costmodel.plan import Plan
from ..costmodel.symbolic import Sym, Tape
from .gate import STEP, GatePlan, LayerCost, gate_costs, layer_cost
from .greedy import Decision, Step, best_of, check_strategies, decision, greedy_path, infeasible

_Key = tuple[int, int | None, tuple[int, ...] | None]
FORM_PATHS = 8  # paths on forms kept per planner, each serving the shapes that follow it
ROUTED_PATHS = 16  # paths on numbers kept for routings that differ between layers
PLANS_KEPT = 64  # plans made per path (what answers hand out), the least recently used giving way
READINGS_KEPT = 64  # shapes whose reading of their path a planner keeps for their next budgets


_ALL = math.inf  # a path on numbers is its own routing's only: everything holds there


class Served(NamedTuple):
    """An answer and where it came from (`PathPlanner.find`): the plan, whether it fits the
    budget (else the most Algorithm 2 saves, with the greedy's end and full recompute to name in
    the error, `ends`), and the path and shape it was read at, which its gates are read at too."""

    decision: Decision
    key: _Key
    path: _Path
    point: np.ndarray | None
    held: float
    fits: bool = True
    ends: tuple[Decision, Decision | None] | None = None


class _Path:
    """Algorithm 2's path computed so far at `loads`, with each plan's footprint. On forms
    (`tape` given), `marks[i]` is what plan i depends on (`Tape.marks`, its need's comparison
    included) and `end` what ended the path; on numbers (no tape) the path is one routing's."""

    def __init__(
        self, cm: CostModel, strategies: Sequence[str], options: MitigationOptions, loads: dict[int, Load], tape: Tape | None = None,
        replay: Sequence[tuple[int, int, bool]] = (),
    ):
        self.cm, self.strategies, self.options, self.loads, self.tape = cm, tuple(strategies), options, loads, tape
        self.recompute = "recompute" in strategies
        with self._recording():
            self.greedy = greedy_path(cm, loads, strategies, options, replay)
        self.steps: list[Step] = []
        self.costs: list[Footprint] = []
        self.marks: list[int] = []
        self.events: list[int] = []  # the greedy's choices each plan follows from
        self.end: int | None = None
        self._need_forms: list[Sym | float] = []
        self._needs: np.ndarray | None = None
        self._plans: OrderedDict[int, Plan] = OrderedDict()
        self._fallback: tuple[Footprint, Sym | float, Plan, int] | None = None
        self._more: Load | None = None  # the loads with `STEP` more pairs (the gates' finite differences)
        self._layers: dict[tuple, LayerCost] = {}  # each block and plan's gate forms

    def _recording(self):
        return self.tape if self.tape is not None else nullcontext()

    def _mark(self) -> int:
        return self.tape.recorded if self.tape is not None else 0

    def advance(self) -> bool:
        """Compute the next plan; False once the path has ended."""
        if self.end is not None:
            return False
        with self._recording():
            try:
                step, cost = next(self.greedy)
            except StopIteration:
                self.end = self._mark()
                return False
            need = cost.needed_bytes  # its room's comparison, before its mark
        if step is not None:
            self.steps.append(step)
        self.costs.append(cost)
        self._need_forms.append(need)
        self.marks.append(self._mark())
        self.events.append(len(self.greedy.events))
        return True

    @classmethod
    def on_forms(cls, cm: CostModel, strategies: Sequence[str], options: MitigationOptions, tape: Tape, replay=()) -> _Path:
        """A path on forms of the shape at `tape`'s reference (its MoE layers at the `routed`
        variable), going on from `replay`'s choices."""
        routed, plain = tape.load(), tape.load(routed=0.0)  # one load per kind of block: alike blocks stay alike
        moe = set(cm.moe_layers)
        return cls(cm, strategies, options, {i: routed if i in moe else plain for i in cm.blocks}, tape, replay)

    def fork(self, shape: Load, plans: int) -> _Path:
        """A path on forms at `shape`, which follows this one for its first `plans` plans: their
        comparisons and the greedy's choices taken over, the rest computed there."""
        tape = self.tape.fork(shape, self.marks[plans - 1])
        return _Path.on_forms(self.cm, self.strategies, self.options, tape, self.greedy.events[: self.events[plans - 1]])

    def held(self, point: np.ndarray | None, known: int = 0) -> float:
        """How many of the comparisons recorded so far hold at `point` before the first that
        does not (the first `known` known to hold); on numbers, every one."""
        return _ALL if point is None else self.tape.held(point, known)

    def plans_held(self, held: float) -> int:
        """How many plans computed so far depend only on `held` comparisons: the shape's too."""
        return bisect_right(self.marks, held)

    def ended(self, held: float) -> bool:
        """Whether the path has ended, for the shape that follows `held` comparisons too."""
        return self.end is not None and held >= self.end

    def needs(self, point: np.ndarray | None, n: int) -> np.ndarray:
        """The needs of the first `n` plans at `point`, in one product."""
        if self._needs is None or len(self._needs) < n:
            forms = self._need_forms
            self._needs = np.array(forms, dtype=float) if point is None else _matrix(forms)
        if point is None:
            return self._needs[:n]
        width = min(self._needs.shape[1], len(point))
        return self._needs[:n, :width] @ point[:width]

    def need(self, i: int, point: np.ndarray | None) -> float:
        return _value(self._need_forms[i], point)

    def plan(self, i: int) -> Plan:
        """The plan after the path's first `i` steps (made from the nearest one made before it)."""
        plan = self._plans.get(i)
        if plan is None:
            below = max((j for j in self._plans if j < i), default=None)
            blocks = {} if below is None else {layer: dict(ops) for layer, ops in self._plans[below].blocks().items()}
            for step in self.steps[0 if below is None else below : i]:
                blocks.setdefault(step.layer, {}).update(dict.fromkeys(step.ops, step.strategy))
            plan = self._plans[i] = Plan.of_blocks({layer: tuple(sorted(ops.items())) for layer, ops in sorted(blocks.items())})
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        self._plans.move_to_end(i)
        return plan

    def decision(self, i: int, point: np.ndarray | None) -> Decision:
        return decision(self.plan(i), _at(self.costs[i], point), i)

    def fallback(self, point: np.ndarray | None, held: float) -> tuple[Decision, float] | None:
        """Full recompute past the path's end (computed once) and its need at the shape, or None
        where its comparisons do not hold there."""
        if self._fallback is None:
            whole = Plan(self.cm.full_recompute())
            with self._recording():
                cost = self.cm.footprint_at(self.loads, whole, self.options)
                need = cost.needed_bytes
            self._fallback = cost, need, whole, self._mark()
        cost, need, plan, mark = self._fallback
        point = self.complete(point)
        if self.held(point, held) < mark:
            return None
        return decision(plan, _at(cost, point), len(self.steps)), _value(need, point)

    def complete(self, point: np.ndarray | None) -> np.ndarray | None:
        """`point` with the variables the tape has made since it was taken (`Tape.complete`)."""
        return None if point is None else self.tape.complete(point)

    def gate_costs(self, plan: Plan, point: np.ndarray) -> dict[int, LayerCost]:
        """`gate.gate_costs` of `plan` at the shape (its routing on every MoE layer), from the
        forms of each block and its plan (made once). What a gate weighs is device bytes, sums of
        the shape's variables that no comparison decides (a threshold, FP8's blocks are variables
        of the shape): its forms hold at every shape."""
        if self._more is None:
            with self.tape:
                self._more = self.tape.load(routed=self.tape.variable("routed") + STEP)
        costs, alike = {}, {}
        for layer in self.cm.moe_layers:
            block, ops = self.cm.blocks[layer], plan.block(layer)
            key = (id(block), ops)
            if key not in alike:
                forms = self._layers.get(key)
                if forms is None:
                    with self.tape:
                        forms = layer_cost(block, dict(ops), self.loads[layer], self._more, self.cm.hardware, self.options)
                    self._layers[key] = forms
                point = self.complete(point)
                alike[key] = LayerCost(*(None if f is None else _value(f, point) for f in forms))
            costs[layer] = alike[key]
        return costs


def _matrix(forms: list[Sym | float]) -> np.ndarray:
    width = max((len(f.coef) for f in forms if isinstance(f, Sym)), default=1)
    out = np.zeros((len(forms), width))
    for i, f in enumerate(forms):
        if isinstance(f, Sym):
            out[i, : len(f.coef)] = f.coef
        else:
            out[i, 0] = f
    return out


def _value(x: Sym | float, point: np.ndarray | None) -> float:
    return x.at(point) if isinstance(x, Sym) else float(x)


def _at(cost: Footprint, point: np.ndarray | None) -> Footprint:
    """A footprint of forms at a shape's variables (its two reloads are the largest there too:
    recorded); one of numbers (no shape) as it is."""
    if point is None:
        return cost
    return Footprint(
        _value(cost.device_bytes, point), _value(cost.host_bytes, point), _value(cost.forward_extra_s, point),
        _value(cost.backward_extra_s, point), tuple(_value(p, point) for p in cost.offload_peaks), _value(cost.transient_bytes, point),
    )


class _Reading:
    """A path read at one shape: the plans the shape follows on it, their needs there, and the
    decisions made of them, kept for the next budget at that shape (`PathPlanner.find`)."""

    __slots__ = ("path", "point", "held", "needs", "decisions")

    def __init__(self, path: _Path, point: np.ndarray | None, held: float, needs: np.ndarray):
        self.path, self.point, self.held, self.needs = path, point, held, needs
        self.decisions: dict[int, Decision] = {}

    def serve(self, key: _Key, floor: int) -> Served | None:
        """The first of its plans that fits `floor`; None where it reads none that does."""
        fits = np.flatnonzero(self.needs <= floor)
        if not len(fits):
            return None
        i = int(fits[0])
        if i not in self.decisions:
            self.decisions[i] = self.path.decision(i, self.point)
        return Served(self.decisions[i], key, self.path, self.point, self.held)


class PathPlanner:
    """Algorithm 2 (§V-A) for repeated budgets, shapes and routings, answered from a few lazily
    extended paths. Budgets are rounded down to `budget_quantum` bytes and local routed pairs up
    to `routed_quantum` pairs, so a plan always fits the budget it is served for and plans a
    slightly heavier routing.

    Counters: `answers` (calls to `answer`), `paths` (paths started), `steps_computed`
    (candidates applied on them), `footprints` (block footprints their greedy runs evaluated: one
    per kind of block and plan, whatever the depth)."""

    def __init__(
        self,
        cm: CostModel,
        budget_quantum: int = 64 << 20,
        routed_quantum: int = 256,
        strategies: Sequence[str] = MITIGATIONS,
        options: MitigationOptions = MitigationOptions(),
    ):
        if budget_quantum <= 0 or routed_quantum <= 0:
            raise ValueError(f"quanta must be > 0, got budget {budget_quantum}, routed {routed_quantum}")
        check_strategies(strategies)
        self.cm, self.strategies, self.options = cm, tuple(strategies), options
        self.budget_quantum, self.routed_quantum = budget_quantum, routed_quantum
        self._forms: list[_Path] = []  # most recently used first
        self._routed: OrderedDict[_Key, _Path] = OrderedDict()
        self._readings: OrderedDict[_Key, _Reading] = OrderedDict()  # the last shapes' readings of their paths
        self.answers = self.paths = self.steps_computed = self.footprints = 0

    def plan(self, budget: float, tokens: int, routed: Sequence[float] | None = None, seq_len: int | None = None) -> Decision:
        """`plan_micro_batch` at the budget rounded down and the routing (pairs per MoE layer)
        rounded up: the first plan on the shape's path that fits, else the greedy's end."""
        return self.answer(self.key(tokens, routed, seq_len), budget)

    def key(self, tokens: int, routed: Sequence[float] | None = None, seq_len: int | None = None) -> _Key:
        """The shape and routing (rounded up) a budget is answered for: `answer`'s first argument,
        for a caller that asks it again and again."""
        q = self.routed_quantum
        return tokens, seq_len, None if routed is None else tuple(math.ceil(r / q) * q for r in routed)

    def answer(self, key: _Key, budget: float) -> Decision:
        """`plan` for the shape and routing `key` names."""
        served = self.find(key, budget)
        if not served.fits:
            raise infeasible(int(budget // self.budget_quantum) * self.budget_quantum, key[0], self.strategies, *served.ends)
        return served.decision

    def find(self, key: _Key, budget: float) -> Served:
        """`answer`, with where it was read (`gates` reads the plan's gates there); an infeasible
        budget is served its best plan, not raised."""
        floor = int(budget // self.budget_quantum) * self.budget_quantum
        self.answers += 1
        tokens, seq_len, pairs = key
        if pairs is not None and len(set(pairs)) > 1:
            path = self._routed.get(key)
            if path is None:
                loads = self.cm.loads(Forward(tokens, seq_len, pairs))  # a bad query raises here, before any path is made
                self.paths += 1
                path = self._routed[key] = _Path(self.cm, self.strategies, self.options, loads)
                while len(self._routed) > ROUTED_PATHS:
                    self._routed.popitem(last=False)
            self._routed.move_to_end(key)
            return self._answer(key, path, None, floor)  # its own routing: it answers
        reading = self._readings.get(key)
        if reading is not None:
            found = reading.serve(key, floor)
            if found is not None:
                self._readings.move_to_end(key)
                return found
        if pairs is not None and len(pairs) != len(self.cm.moe_layers):
            self.cm.loads(Forward(tokens, seq_len, pairs))  # the error that names the layers
        shape = self.cm.layer_load(tokens, pairs[0] if pairs else None, seq_len)  # its MoE layers' (a bad query raises here)
        longest, source = 0, None  # the kept path the shape follows furthest
        for path in self._forms:
            found = self._answer(key, path, path.tape.point(shape), floor)
            if isinstance(found, Served):
                if path is not self._forms[0]:
                    self._forms.remove(path)
                    self._forms.insert(0, path)
                return found
            if found > longest:
                longest, source = found, path
        self.paths += 1
        if source is not None:
            path = source.fork(shape, longest)
        else:  # the first: computed whole now (the run's first micro-batch pays for it), so that a deep plan later is a lookup
            path = _Path.on_forms(self.cm, self.strategies, self.options, Tape(shape))
            while path.advance():
                self.steps_computed += len(path.costs) > 1
            self.footprints += path.greedy.footprints
        self._forms.insert(0, path)
        del self._forms[FORM_PATHS:]
        return self._answer(key, path, path.tape.point(shape), floor)  # a path holds at its own shape

    def gates(self, served: Served, planned: float | dict[int, float], heaviest: float | dict[int, float]) -> GatePlan:
        """The served plan's gates (`GatePlan.of`) at its shape, planned for `planned` local pairs
        per MoE layer (the routing it was served for) and leaving room for `heaviest`: read off
        the forms of its path."""
        d = served.decision
        if served.point is not None:
            return GatePlan.of(d, served.path.gate_costs(d.plan, served.point), planned, heaviest)
        tokens, seq_len, pairs = served.key  # a routing of its own per layer: priced at it
        costs = gate_costs(self.cm, d.plan, tokens, seq_len, dict(zip(self.cm.moe_layers, map(float, pairs))), self.options)
        return GatePlan.of(d, costs, planned, heaviest)

    def _answer(self, key: _Key, path: _Path, point: np.ndarray | None, floor: int) -> Served | int:
        """The first plan on `path` that fits `floor` at the shape `point` (None: the path's own
        routing), or the greedy's end past it; where the shape's path leaves this one first, how
        many of its plans the shape's has too."""
        held = path.held(point)
        n = path.plans_held(held)
        reading = _Reading(path, point, held, path.needs(point, n))
        if point is not None:
            self._readings[key] = reading
            while len(self._readings) > READINGS_KEPT:
                self._readings.popitem(last=False)
        found = reading.serve(key, floor)
        if found is not None:
            return found
        if n < len(path.costs):
            return n
        while True:
            footprints = path.greedy.footprints
            more = path.advance()
            point = path.complete(point)
            held = path.held(point, held)
            if not more:
                break
            self.steps_computed += len(path.costs) > 1
            self.footprints += path.greedy.footprints - footprints
            i = len(path.costs) - 1
            if path.plans_held(held) <= i:
                return i
            if path.need(i, point) <= floor:
                return Served(path.decision(i, point), key, path, point, held)
        if not path.ended(held):
            return len(path.costs)  # the path ends here, not there
        last, whole = path.decision(len(path.costs) - 1, point), None
        if path.recompute:
            fallback = path.fallback(point, held)
            if fallback is None:
                return len(path.costs)
            point = path.complete(point)
            held = path.held(point, held)
            whole, need = fallback
            if need <= floor:
                return Served(whole, key, path, point, held)
        return Served(best_of(last, whole), key, path, point, held, fits=False, ends=(last, whole))
