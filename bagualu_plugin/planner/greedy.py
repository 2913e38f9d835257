"""Per-operator mitigation of one micro-batch under its budget: Algorithm 2 of paper §V-A.

Start with nothing mitigated; while the micro-batch would need more than its budget (what it
keeps, and room for its backward to bring its offloaded copies back: `Footprint.needed_bytes`),
apply the single (op, strategy) candidate with the largest memory reduction on the current plan
(a reduction is re-evaluated after every choice: recomputing an op makes offloading what it made
pointless). A candidate that would conflict with what is already applied (§V-A, cases 1 and 2)
is marked unavailable rather than undoing the earlier, larger reduction. Recompute candidates
are recompute units (`BlockGraph.recompute_unit`). The greedy's choices need not reach what
full recompute keeps (M0, which Algorithm 1 guarantees: under expert parallelism a mix of
offloads and casts of the largest tensors can stop above it), so where recompute is allowed
and the greedy ends over the budget, full recompute is the plan if it fits.

A candidate changes one block, so its reduction is that block's change and what the block
changes of the whole: the two largest reloads (`Footprint.room_bytes`) and the layer arguments
that some recompute region holds. Ties go to the larger memory freed, then to the smaller time
added, then to the candidate first in program order (lower layer, then the block's own order).
The decoder layers of one kind (one graph, one load) are alike: the greedy prices a candidate
once per kind and plan (`_Local`), not once per layer, so a model of 92 layers costs little more
than one of 4.

Sums of the same costs in another order round differently, so differences below `BYTE_TIE` and
`TIME_TIE` are ties (the greedy before 2026-12 let that noise pick between equal candidates).

The greedy's choices never depend on the budget, only where it stops: `greedy_path` yields its
successive steps, `plan_micro_batch` takes the first that fits, and `PathPlanner` (planner/path.py)
keeps the path to answer every budget from it. It runs on numbers, or on forms of the shape
(`costmodel.symbolic`), recording each comparison that decided a step: the path then holds for
every shape that satisfies them. Pure arithmetic over a `CostModel`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..costmodel.conflicts import block_conflicts
from ..costmodel.forward import Forward, Routed
from ..costmodel.graph import BlockGraph, OpId
from ..costmodel.linear import Load
from ..costmodel.mitigation import MITIGATIONS, Footprint, MitigationOptions, footprint
from ..costmodel.model import CostModel, holds_arguments
from ..costmodel.plan import Block, Plan
from ..costmodel.symbolic import Sym, upper


class InfeasibleBudget(RuntimeError):
    """No mitigation the plan may use brings the micro-batch under its budget; `best` is the
    plan Algorithm 2 reached, the most it can save."""

    def __init__(self, message: str, best: Decision):
        super().__init__(message)
        self.best = best


@dataclass(frozen=True)
class Decision:
    plan: Plan
    activation_bytes: float  # predicted device bytes kept by the micro-batch under `plan`
    room_bytes: float  # room beyond what it keeps: its backward's reloads or a moment's saves (`Footprint.room_bytes`)
    forward_extra_s: float
    backward_extra_s: float
    steps: int  # candidates applied


class Step(NamedTuple):
    """One applied candidate: `ops` of decoder layer (or block) `layer` set to `strategy`."""

    layer: int
    ops: tuple[str, ...]
    strategy: str

    def opids(self) -> list[OpId]:
        return [OpId(self.layer, name) for name in self.ops]


def candidates(block: BlockGraph, strategies: Sequence[str]) -> list[tuple[tuple[str, ...], str]]:
    """A block's candidates in program order: each op with each strategy, recompute as the op's unit."""
    out: list[tuple[tuple[str, ...], str]] = []
    for op in block.op_names:
        for strategy in strategies:
            ops = block.recompute_unit(op) if strategy == "recompute" else (op,)
            if ops and (ops, strategy) not in out:
                out.append((ops, strategy))
    return out


def check_strategies(strategies: Sequence[str]) -> None:
    unknown = set(strategies) - set(MITIGATIONS)
    if unknown:
        raise ValueError(f"strategies: unknown {sorted(unknown)}; expected some of {MITIGATIONS}")


def greedy_path(
    cm: CostModel, loads: Mapping[int, Load], strategies: Sequence[str] = MITIGATIONS, options: MitigationOptions = MitigationOptions(),
    replay: Sequence[tuple[int, int, bool]] = (),
) -> GreedyPath:
    """Algorithm 2's successive plans (§V-A) at `loads` (`CostModel.loads`: numbers, or forms of
    the shape), as (the step applied, the micro-batch's footprint then): nothing mitigated first
    (step None), then one per applied candidate, until no candidate reduces the need. A choice
    depends only on the plan so far, never on the budget, and `needed_bytes` never grows along
    the path: a budget's plan is the first that fits it."""
    check_strategies(strategies)
    return GreedyPath(cm, loads, tuple(strategies), options, replay)


def plan_of(steps: Sequence[Step]) -> Plan:
    """The plan the first `steps` of a path make."""
    return Plan({op: s.strategy for s in steps for op in s.opids()})


class _Kind:
    """Blocks the greedy treats alike: one graph, one load, the same layer arguments in reach;
    `args` are those arguments (indices into `_Greedy.args`)."""

    __slots__ = ("block", "load", "args", "candidates", "bounds", "locals")

    def __init__(self, block: BlockGraph, load: Load, args: tuple[int, ...], strategies: Sequence[str]):
        self.block, self.load, self.args = block, load, args
        self.candidates = candidates(block, strategies)
        self.bounds = [_bound(block, load, ops, strategy) for ops, strategy in self.candidates]
        self.locals: dict[Block, _Local] = {}


def _bound(block: BlockGraph, load: Load, ops: tuple[str, ...], strategy: str) -> object:
    """The most device bytes a candidate can free in its block, whatever the plan: the tensors its
    ops save, and for a recompute those its ops take in too (a region input no op saves is held
    until a larger region makes it)."""
    names = set(ops)
    inputs = {i for op in block.ops if op.name in names for i in op.inputs} if strategy == "recompute" else set()
    return sum((t.bytes(load) for t in block.tensors if names & set(t.savers) or t.name in inputs), 0.0)


class _Local:
    """One kind under one block plan: its footprint, whether its regions hold the layer
    arguments, and each candidate's trial (the plan it makes, or None where it changes nothing or
    is blocked by a recompute), found when first asked."""

    __slots__ = ("kind", "plan", "cost", "holds", "_trials", "_conflicts", "_order", "_uppers", "priced")

    def __init__(self, kind: _Kind, plan: Block, hardware, options: MitigationOptions):
        self.kind, self.plan = kind, plan
        strategies = dict(plan)
        self.cost = footprint(kind.block, strategies, kind.load, hardware, options)
        self.holds = holds_arguments(kind.block, strategies)
        self._trials: dict[int, Block | None] = {}
        self._conflicts: bool | None = None
        self._order: list[int] | None = None
        self._uppers: dict[int, object] = {}
        self.priced: dict[int, tuple] = {}  # candidate: (its trial, the device bytes it frees in the block, the seconds it adds)

    @property
    def order(self) -> list[int]:
        """Its candidates that change its plan, largest bound first (`_Kind.bounds`): the order
        they are priced in."""
        if self._order is None:
            bounds = self.kind.bounds
            self._order = sorted((t for t in range(len(bounds)) if self.trial(t) is not None), key=lambda t: -_reference(bounds[t]))
        return self._order

    def upper(self, i: int) -> object:
        """A bound of every candidate from `order[i]` on (`symbolic.upper`)."""
        if i not in self._uppers:
            self._uppers[i] = upper([self.kind.bounds[t] for t in self.order[i:]])
        return self._uppers[i]

    @property
    def conflicts(self) -> bool:
        """Whether its plan has a conflict of §V-A (`costmodel.conflicts`)."""
        if self._conflicts is None:
            self._conflicts = bool(block_conflicts(self.kind.block, dict(self.plan)))
        return self._conflicts

    def trial(self, t: int) -> Block | None:
        if t not in self._trials:
            ops, strategy = self.kind.candidates[t]
            plan = dict(self.plan)
            if all(plan.get(op) == strategy for op in ops):
                trial = None
            elif strategy != "recompute" and any(plan.get(op) == "recompute" for op in ops):
                trial = None  # an op in a recompute unit keeps nothing to offload or quantise
            else:
                trial = tuple(sorted({**plan, **dict.fromkeys(ops, strategy)}.items()))
            self._trials[t] = trial
        return self._trials[t]


class _Group:
    """The layers of one kind with one plan and one set of candidates marked unavailable, lowest
    first: a candidate's reduction is the same for each, so it is priced once and applied to the
    lowest (ties go to program order)."""

    __slots__ = ("local", "removed", "members", "best", "version")

    def __init__(self, local: _Local, removed: frozenset[int]):
        self.local, self.removed, self.members = local, removed, []
        self.best: tuple | None = None
        self.version = -1


# Differences this small are ties: sums of the same costs in another order differ by rounding
# (bytes of a fractional routing, seconds always), and a tie goes to program order, not to the noise.
BYTE_TIE = 1e-3  # below a byte: integral byte counts compare exactly
TIME_TIE = 1e-12  # a picosecond
_TIES = (BYTE_TIE, BYTE_TIE, TIME_TIE)  # of a key's (reduction, freed, -added)


def _sign(x, tie: float) -> int:
    """-1, 0 or 1: the sign of a number, or of a form at the reference shape (recorded), beyond `tie`."""
    return 1 if x > tie else -1 if x < -tie else 0


def _better(a: tuple, b: tuple) -> int:
    """Which of two keys (reduction, freed, -added) is larger: 1 (a), -1 (b) or 0."""
    for x, y, tie in zip(a, b, _TIES):
        s = _sign(x - y, tie)
        if s:
            return s
    return 0


class _Peaks:
    """The reloads each block's plan brings back (`Footprint.offload_peaks`, at most two per
    block), per kind and plan with its number of blocks, sorted largest first as they come: the
    whole micro-batch's two largest, and a trial's (one block's plan replaced), are read off the
    top without sorting again."""

    def __init__(self):
        self.entries: list[tuple[object, _Local]] = []  # (reload, the kind and plan it comes from), largest first
        self.count: dict[_Local, int] = {}

    def move(self, old: _Local | None, new: _Local, n: int = 1) -> None:
        """`n` blocks move from plan `old` (None: they join) to `new`."""
        if old is not None:
            left = self.count[old] - n
            if left:
                self.count[old] = left
            else:
                del self.count[old]
                self.entries = [e for e in self.entries if e[1] is not old]
        if new in self.count:
            self.count[new] += n
            return
        self.count[new] = n
        for peak in new.cost.offload_peaks:
            lo, hi = 0, len(self.entries)
            while lo < hi:  # first entry below this one: equal ones stay in the order they came
                mid = (lo + hi) // 2
                if peak > self.entries[mid][0]:
                    hi = mid
                else:
                    lo = mid + 1
            self.entries.insert(lo, (peak, new))

    def top(self, without: _Local | None = None, n: int = 2) -> list:
        """The `n` largest reloads, one block of plan `without` taken out."""
        out = []
        for peak, local in self.entries:
            copies = self.count[local] - (local is without)
            out.extend([peak] * min(copies, n - len(out)))
            if len(out) == n:
                break
        return out

    def head(self) -> tuple:
        """What a trial's reloads depend on: the first four (two blocks' worth), by identity."""
        return tuple((id(p), id(local)) for p, local in self.entries[:4] for _ in range(min(self.count[local], 4)))[:4]


def _largest_two(a: list, b: Sequence) -> list:
    """The two largest of two lists, each largest first."""
    out, i, j = [], 0, 0
    while len(out) < 2 and (i < len(a) or j < len(b)):
        if j == len(b) or (i < len(a) and a[i] >= b[j]):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out


class GreedyPath:
    """Algorithm 2 run once over a cost model at given loads, an iterator of its steps
    (`greedy_path`). `events`: each choice it made, (layer, candidate, applied): a candidate
    applied, or marked unavailable for a conflict; `footprints`: the block footprints it has
    evaluated, one per kind of block and plan. `replay`: the events of a path at other loads
    whose choices hold at these too (`planner.path`), made again without choosing."""

    def __init__(
        self, cm: CostModel, loads: Mapping[int, Load], strategies: tuple[str, ...], options: MitigationOptions,
        replay: Sequence[tuple[int, int, bool]] = (),
    ):
        self.cm, self.options = cm, options
        # the layer arguments a recompute region may hold (position ids, masks): bytes, and the blocks whose regions take them
        self.args: list[tuple[object, frozenset[int]]] = [
            (t.bytes(loads[i]), frozenset(t.held_by) & set(cm.blocks))
            for i, block in cm.blocks.items() for t in block.tensors if t.held_by
        ]
        kinds: dict[tuple, _Kind] = {}
        self.kind_of: dict[int, _Kind] = {}
        for i, block in cm.blocks.items():
            args = tuple(a for a, (_, holders) in enumerate(self.args) if i in holders)
            key = (id(block), loads[i], args)
            if key not in kinds:
                kinds[key] = _Kind(block, loads[i], args, strategies)
            self.kind_of[i] = kinds[key]
        self.transient = max((k.block.transient.at(k.load) for k in kinds.values()), default=0.0)
        self.events: list[tuple[int, int, bool]] = []
        self._steps = self._path(replay)

    def __iter__(self) -> GreedyPath:
        return self

    def __next__(self) -> tuple[Step | None, Footprint]:
        return next(self._steps)

    @property
    def footprints(self) -> int:
        return sum(len(kind.locals) for kind in {id(k): k for k in self.kind_of.values()}.values())

    def _local(self, kind: _Kind, plan: Block) -> _Local:
        local = kind.locals.get(plan)
        if local is None:
            local = kind.locals[plan] = _Local(kind, plan, self.cm.hardware, self.options)
        return local

    def _path(self, replay: Sequence[tuple[int, int, bool]]) -> Iterator[tuple[Step | None, Footprint]]:
        self._groups: dict[tuple[_Local, frozenset[int]], _Group] = {}
        self._group_of: dict[int, _Group] = {}
        self._peaks, self._holding = _Peaks(), [0] * len(self.args)
        self._version = 0
        self._compared: tuple[int, dict] = (0, {})
        for i in self.cm.blocks:
            self._join(i, self._local(self.kind_of[i], ()), frozenset())
        totals = [0.0] * 4  # device (with the layer arguments held), host, forward and backward seconds
        for group in self._groups.values():
            n, cost = len(group.members), group.local.cost
            for j, x in enumerate((cost.device_bytes, cost.host_bytes, cost.forward_extra_s, cost.backward_extra_s)):
                totals[j] += x * n
            self._peaks.move(None, group.local, n)
            if group.local.holds:
                for a in group.local.kind.args:
                    self._holding[a] += n
        totals[0] += sum((b for a, (b, _) in enumerate(self.args) if self._holding[a]), 0.0)
        self._totals, self._head = totals, self._peaks.head()
        yield None, self._footprint()
        for layer, t, _ in replay:
            step = self._apply(layer, t)
            if step is not None:
                yield step, self._footprint()
        while True:
            chosen = self._choose()
            if chosen is None:
                return
            step = self._apply(*chosen)
            if step is not None:
                yield step, self._footprint()

    def _footprint(self) -> Footprint:
        return Footprint(*self._totals, tuple(self._peaks.top()), self.transient)

    def _join(self, layer: int, local: _Local, removed: frozenset[int]) -> None:
        group = self._groups.get((local, removed))
        if group is None:
            group = self._groups[local, removed] = _Group(local, removed)
        bisect.insort(group.members, layer)
        self._group_of[layer] = group

    def _choose(self) -> tuple[int, int] | None:
        """The (layer, candidate) with the largest key (reduction, freed, -added), first in program
        order among equal ones; None where no candidate is useful."""
        room = max(sum(self._peaks.top(), 0.0), self.transient)
        best = None  # (key, layer, candidate)
        for group in self._groups.values():
            if group.version != self._version:
                group.best, group.version = self._best(group, self._peaks, self._holding, room), self._version
            if group.best is None:
                continue
            key, t = group.best
            if best is None:
                best = (key, group.members[0], t)
                continue
            s = self._compare(key, best[0])
            if s > 0 or (s == 0 and (group.members[0], t) < best[1:]):
                best = (key, group.members[0], t)
        return None if best is None else best[1:]

    def _compare(self, a: tuple, b: tuple) -> int:
        """`_better(a, b)`, remembered while the groups keep their keys (a run of steps compares
        the same ones again: on forms, a comparison recorded once)."""
        if self._compared[0] != self._version:
            self._compared = (self._version, {})
        known = self._compared[1].get((id(a), id(b)))
        if known is None or known[0] is not a or known[1] is not b:
            known = self._compared[1][id(a), id(b)] = (a, b, _better(a, b))
        return known[2]

    def _apply(self, layer: int, t: int) -> Step | None:
        """Candidate `t` of `layer`'s block applied (its Step), or marked unavailable where it
        conflicts with what the block has (None): the applied plan has no conflict, so only its
        block may."""
        group = self._group_of[layer]
        local = group.local
        trial = self._local(local.kind, local.trial(t))
        group.members.remove(layer)
        if not group.members:
            del self._groups[local, group.removed]
        applied = not trial.conflicts
        self.events.append((layer, t, applied))
        if not applied:
            self._join(layer, local, group.removed | {t})
            return None
        delta = self._arguments(local, trial, self._holding)
        for j, (a, b) in enumerate(zip(
            (trial.cost.device_bytes, trial.cost.host_bytes, trial.cost.forward_extra_s, trial.cost.backward_extra_s),
            (local.cost.device_bytes, local.cost.host_bytes, local.cost.forward_extra_s, local.cost.backward_extra_s),
        )):
            self._totals[j] += a - b + (delta if j == 0 else 0.0)
        self._peaks.move(local, trial)
        if local.holds != trial.holds:
            for a in local.kind.args:
                before = self._holding[a]
                self._holding[a] += 1 if trial.holds else -1
                if min(before, 2) != min(self._holding[a], 2):
                    self._version += 1  # what the arguments add or give back has changed
        self._join(layer, trial, group.removed)
        if self._peaks.head() != self._head:
            self._version, self._head = self._version + 1, self._peaks.head()
        ops, strategy = local.kind.candidates[t]
        return Step(layer, ops, strategy)

    def _arguments(self, local: _Local, trial: _Local, holding: list[int]) -> object:
        """The layer-argument bytes one block's move from `local` to `trial` adds (or, negative, gives back)."""
        if local.holds == trial.holds:
            return 0.0
        if trial.holds:
            return sum((self.args[a][0] for a in local.kind.args if holding[a] == 0), 0.0)
        return -sum((self.args[a][0] for a in local.kind.args if holding[a] == 1), 0.0)

    def _best(self, group: _Group, peaks: _Peaks, holding: list[int], room) -> tuple | None:
        """The group's useful candidate with the largest key (reduction, freed, -added), the first in
        program order among equal ones, or None. A candidate is priced (its trial's footprint) only
        where its bound (`_Kind.bounds`) could reach the best so far: the others lose by their
        bounds, whatever the branches their footprints would take."""
        local, best = group.local, None
        kind = local.kind
        others = peaks.top(without=local)
        # beyond the bytes its tensors keep, a trial can give back the reloads only this block's
        # plan brings to the top two, and the layer arguments its regions hold
        extra = room - max(sum(others, 0.0), self.transient)
        if local.holds:
            extra = extra + sum((self.args[a][0] for a in kind.args), 0.0)
        order = local.order
        for i, t in enumerate(order):
            if t in group.removed:
                continue
            # the rest far below the best (half of it at most): they lose by their bounds, whatever
            # branches their footprints would take, where the shape moves them and the best apart
            if best is not None and _reference(kind.bounds[t] + extra) <= _reference(best[0][0]) / 2:
                if _sign(best[0][0] - local.upper(i) - extra, BYTE_TIE) > 0:
                    break
            priced = local.priced.get(t)
            if priced is None:
                trial = self._local(kind, local.trial(t))
                cost, now = trial.cost, local.cost
                added = cost.forward_extra_s + cost.backward_extra_s - now.forward_extra_s - now.backward_extra_s
                priced = local.priced[t] = trial, now.device_bytes - cost.device_bytes, added
            trial, kept, added = priced
            freed = kept - self._arguments(local, trial, holding)
            reload = sum(_largest_two(others, trial.cost.offload_peaks), 0.0)
            reduction = freed + room - max(reload, self.transient)
            # the first offloads may free only what their copies need back in backward (the two
            # largest ops' copies come back at once); they still make room for the next ones
            s = _sign(reduction, BYTE_TIE)
            if s < 0 or (s == 0 and not freed > BYTE_TIE):
                continue
            key = (reduction, freed, -added)
            if best is None:
                best = (key, t)
                continue
            s = _better(key, best[0])
            if s > 0 or (s == 0 and t < best[1]):
                best = (key, t)
        return best


def _reference(x) -> float:
    """A number, or a form's value at the reference shape: an order to try candidates in, no decision."""
    return x.value if isinstance(x, Sym) else x


def plan_micro_batch(
    cm: CostModel,
    budget: float,
    tokens: int,
    routed: Routed = None,
    seq_len: int | None = None,
    strategies: Sequence[str] = MITIGATIONS,
    options: MitigationOptions = MitigationOptions(),
) -> Decision:
    """The plan Algorithm 2 chooses for a micro-batch of `tokens` that may keep `budget` bytes:
    the reference every served plan equals, computed from scratch."""
    steps: list[Step] = []
    forward = Forward(tokens, seq_len, routed)
    for step, current in greedy_path(cm, cm.loads(forward), strategies, options):
        if step is not None:
            steps.append(step)
        if current.needed_bytes <= budget:
            return decision(plan_of(steps), current, len(steps))
    last, whole = decision(plan_of(steps), current, len(steps)), None
    if "recompute" in strategies:
        plan = Plan(cm.full_recompute())
        whole = decision(plan, cm.footprint(forward, plan, options), len(steps))
        if whole.activation_bytes + whole.room_bytes <= budget:
            return whole
    raise infeasible(budget, tokens, strategies, last, whole)


def infeasible(budget: float, tokens: int, strategies: Sequence[str], last: Decision, whole: Decision | None) -> InfeasibleBudget:
    """A new `InfeasibleBudget` for `budget` (never re-raise a kept one: each raise chains the
    raiser's frames onto its traceback), its best plan the greedy's end `last` or, past it, full
    recompute (`whole`, where recompute is allowed: M0, which Algorithm 1 guarantees),
    whichever needs less: the gates' escalations start from it."""
    best = best_of(last, whole)
    return InfeasibleBudget(
        f"budget {budget:.0f} bytes is below what any plan of {', '.join(strategies)} keeps: at best "
        f"{best.activation_bytes + best.room_bytes:.0f} bytes for {tokens} tokens; raise the budget (capacity, reserve, "
        "in-flight micro-batches) or allow more strategies",
        best,
    )


def best_of(last: Decision, whole: Decision | None) -> Decision:
    """What an infeasible budget gets: the greedy's end or full recompute, whichever needs less."""
    return whole if whole is not None and whole.activation_bytes + whole.room_bytes < last.activation_bytes + last.room_bytes else last


def decision(plan: Plan, cost: Footprint, steps: int) -> Decision:
    return Decision(plan, cost.device_bytes, cost.room_bytes, cost.forward_extra_s, cost.backward_extra_s, steps)
