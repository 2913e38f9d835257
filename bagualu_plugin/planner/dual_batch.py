"""Fused dual-batch execution (paper §V-B): the order in which one steady scheduling point F_x B_y
runs its four operator classes, the forward of x (F), the backward of y (B), the offload of x-1
(O) and the recovery, reload and recompute, of y+1 (R), on a compute stream and a copy /
communication stream.

The classes have no data dependencies on each other (four different micro-batches: hence the
pipeline degree must exceed 2), and each is a chain. A class's operators are compacted into
stages split at its communication ops (dispatch / combine all-to-all, offload / reload copies):
a stage is consecutive work on one stream, `StageTime(compute_s, copy_s)`. `solve` is the DP
F[i][j][k][l] of §V-B over prefixes of the four stage lists: a transition runs, together, the
next consecutive stages of any classes, costing `window_time`: the classes share the two
streams, and each class's own stages still follow one another. Prefixes only ever grow, so the
order inside every class is the program order. The transfer points give the order back.

Runtime solving: a scheduling point's stage lists follow from the micro-batches' plans, which
follow from the budget and the routing; `ScheduleCache` solves a point block by block and keeps
each block's part, keyed by the plan entries of that block alone: budgets repeat with the
pipeline phase and routing is stable in most iterations, so most blocks skip the DP.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from ..costmodel import CostModel, OpId
from ..costmodel.forward import Forward, Routed
from ..costmodel.graph import COMM_OPS
from ..costmodel.mitigation import Footprint, MitigationOptions, footprint
from ..costmodel.plan import Plan

CLASSES = ("F", "B", "O", "R")
USES = ({"fp8"}, {"fp8"}, {"offload"}, {"offload", "recompute"})  # the strategies whose work each class runs


@dataclass(frozen=True)
class StageTime:
    """One stage: seconds on the compute stream and on the copy / communication stream."""

    compute_s: float = 0.0
    copy_s: float = 0.0

    def __post_init__(self) -> None:
        if self.compute_s < 0 or self.copy_s < 0:
            raise ValueError(f"stage times must be >= 0, got compute {self.compute_s}, copy {self.copy_s}")


Stages = Sequence[Sequence[StageTime]]  # per class (F, B, O, R), its stages in program order


def window_time(runs: Stages) -> float:
    """T of §V-B: the time of running, together, one run of consecutive stages per class. The
    classes share the two streams (each stream's total), and a class's stages follow one another
    (its own total on both streams)."""
    compute = sum(s.compute_s for run in runs for s in run)
    copy = sum(s.copy_s for run in runs for s in run)
    chain = max((sum(s.compute_s + s.copy_s for s in run) for run in runs), default=0.0)
    return max(compute, copy, chain)


@dataclass(frozen=True)
class Schedule:
    """The DP's answer: the predicted time, the windows, each the (start, end) stage range of
    every class that runs in it (empty ranges for classes that do not), and the time of the same
    stages one class after another (no overlap: what the fused order saves on)."""

    time_s: float
    windows: tuple[tuple[tuple[int, int], ...], ...]
    serial_s: float

    def order(self) -> list[tuple[str, int]]:
        """(class, stage) in issue order: window by window, classes in F, B, O, R order."""
        return [(CLASSES[c], s) for window in self.windows for c, (a, b) in enumerate(window) for s in range(a, b)]


def solve(stages: Stages) -> Schedule:
    """The DP of §V-B over the four classes' stage prefixes (fewer classes are allowed: an empty
    stage list). O(prod(n_c + 1)^2) transitions: fine for the handful of stages compaction leaves.
    States run in product order (every prefix before the states it grows into); a state's best
    is its first cheapest predecessor in product order. The loops nest one class per level, so a
    transition's stream totals are summed class by class as the levels go down."""
    lists = [tuple(run) for run in stages]
    if len(lists) != len(CLASSES):
        raise ValueError(f"give one stage list per class {CLASSES}, got {len(lists)}")
    sizes = tuple(len(run) for run in lists)
    spans = []  # per class: spans[c][start][end] = (compute, copy, both) of stages start..end-1
    for run in lists:
        prefix = [(0.0, 0.0, 0.0)]
        for s in run:
            a, b, ab = prefix[-1]
            prefix.append((a + s.compute_s, b + s.copy_s, ab + s.compute_s + s.copy_s))
        spans.append([[(hi[0] - lo[0], hi[1] - lo[1], hi[2] - lo[2]) for hi in prefix] for lo in prefix])
    s0, s1, s2, s3 = spans
    best: dict[tuple[int, ...], tuple[float, tuple[int, ...] | None]] = {}
    for end in itertools.product(*(range(n + 1) for n in sizes)):
        if not any(end):
            best[end] = (0.0, None)
            continue
        e0, e1, e2, e3 = end
        found, where = float("inf"), None
        for a in range(e0 + 1):
            x0, y0, z0 = s0[a][e0]
            x0, y0, z0 = 0.0 + x0, 0.0 + y0, max(0.0, z0)
            for b in range(e1 + 1):
                x, y, z = s1[b][e1]
                x1, y1, z1 = x0 + x, y0 + y, max(z0, z)
                for c in range(e2 + 1):
                    x, y, z = s2[c][e2]
                    x2, y2, z2 = x1 + x, y1 + y, max(z1, z)
                    for d in range(e3 + 1):
                        start = (a, b, c, d)
                        if start == end:
                            continue
                        x, y, z = s3[d][e3]
                        total = best[start][0] + max(x2 + x, y2 + y, max(z2, z))
                        if total < found:
                            found, where = total, start
        best[end] = (found, where)
    total, windows, end = best[sizes][0], [], sizes
    while any(end):
        start = best[end][1]
        windows.append(tuple(zip(start, end)))
        end = start
    return Schedule(total, tuple(reversed(windows)), sum(window_time([run]) for run in lists))


def brute_force(stages: Stages) -> float:
    """The same minimum by enumerating every monotone path of prefixes (tests only)."""
    sizes = tuple(len(run) for run in stages)

    def paths(end: tuple[int, ...]):
        if not any(end):
            yield 0.0
            return
        for start in itertools.product(*(range(e + 1) for e in end)):
            if start != end:
                step = window_time([run[a:b] for run, a, b in zip(stages, start, end)])
                for head in paths(start):
                    yield head + step

    return min(paths(sizes))


class ScheduleCache:
    """Schedules of the fused points as the executor runs them (§V-B "runtime solving"), on a rank
    holding model `chunks` (one without interleaving), routing balanced. A point is solved one
    block at a time (`solve_blocks`). Each class's stages at a block depend only on its model
    chunk, the block and its plan's entries for that block: they are computed once each; a
    block's part is solved once per four classes' stages; a point seen before is one lookup on
    its four plans. The fused executor and the simulator (`sim`) both use it."""

    def __init__(self, chunks: Sequence[CostModel], options: MitigationOptions = MitigationOptions()):
        self.chunks, self.options = tuple(chunks), options
        self._parts: dict[tuple, tuple[Schedule, tuple[int, ...]]] = {}  # by the four classes' stages
        self._stages: dict[tuple, tuple[StageTime, ...]] = {}  # by (class, chunk, block, entries, tokens, seq_len)
        self._points: dict[Hashable, tuple[Schedule, int]] = {}  # whole points seen, by their plans (hashed once each), and their blocks
        self._positions: dict[tuple[int, ...], list[tuple[int | None, ...]]] = {}
        self._loads: dict[tuple, list] = {}
        self.hits = self.misses = 0  # blocks

    def get(self, tokens: int, seq_len: int | None, which: Sequence[int], plans: Sequence[Plan | None]) -> tuple[Schedule, bool]:
        """The point F_x B_y whose four classes run model chunks `which` under `plans` (x, y, x-1,
        y+1; None for a micro-batch the point does not touch): its schedule, and whether every
        block's part came from the cache."""
        which = tuple(which)
        point = (tokens, seq_len, which, *plans)
        seen = self._points.get(point)
        if seen is not None:
            self.hits += seen[1]
            return seen[0], True
        positions = self._positions.get(which)
        if positions is None:
            positions = self._positions[which] = _positions([self.chunks[c] for c in which])
        parts, hit = [], True
        for blocks in positions:
            stages = tuple(
                self._class_stages(c, which[c], i, plan.block(i) if plan is not None and i is not None else (), tokens, seq_len)
                for c, (plan, i) in enumerate(zip(plans, blocks))
            )
            part = self._parts.get(stages)
            if part is None:
                self.misses, hit = self.misses + 1, False
                part = self._parts[stages] = (solve(stages), tuple(len(run) for run in stages))
            else:
                self.hits += 1
            parts.append(part)
        schedule = _joined(parts)
        self._points[point] = schedule, len(parts)
        return schedule, hit

    def _class_stages(
        self, c: int, chunk: int, block: int | None, entries: tuple[tuple[str, str], ...], tokens: int, seq_len: int | None,
    ) -> tuple[StageTime, ...]:
        """Class c's stages at `block` of `chunk` under its plan's `entries`, as an executor runs
        them (`piece_stages`): computed once per the entries of the strategies the class runs
        (`USES`: a layer's escalation to recompute leaves its F, B and O stages as they were)."""
        entries = tuple(e for e in entries if e[1] in USES[c])
        key = (c, chunk, block, entries, tokens, seq_len)
        stages = self._stages.get(key)
        if stages is None:
            model = self.chunks[chunk]
            run = _class_stages(c, model, self._load(chunk, tokens, seq_len), entries, block, self.options)
            stages = self._stages[key] = tuple(_piece(c, run))
        return stages

    def _load(self, chunk: int, tokens: int, seq_len: int | None) -> list:
        key = (chunk, tokens, seq_len)
        if key not in self._loads:
            self._loads[key] = self.chunks[chunk].loads(Forward(tokens, seq_len))
        return self._loads[key]

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0


def _positions(models: Sequence[CostModel]) -> list[tuple[int | None, ...]]:
    """The blocks the four classes run at each position of a point: F and O in program order, B and
    R in reverse, None past a (shorter) chunk's end."""
    orders = [list(m.blocks) if c in (0, 2) else list(reversed(m.blocks)) for c, m in enumerate(models)]
    return [tuple(order[k] if k < len(order) else None for order in orders) for k in range(max(map(len, orders)))]


def _class_stages(
    c: int, model: CostModel, loads: Sequence, entries: tuple[tuple[str, str], ...], i: int | None, options: MitigationOptions,
) -> list[StageTime]:
    """Class c's stages at one position of a point (an element of `point_stages`' entries): it
    runs block `i` of `model` (None: past its chunk's end, no stages) under its plan's `entries`
    for that block."""
    if i is None:
        return []
    block, load = model.blocks[i], loads[i]

    def extra(only: str) -> Footprint:
        return footprint(block, {name: s for name, s in entries if s == only}, load, model.hardware, options)

    def ops(reverse: bool) -> list[StageTime]:
        out = []
        for op in (reversed(block.ops) if reverse else block.ops):
            t = (op.backward_s if reverse else op.forward_s).at(load)
            out.append(StageTime(copy_s=t) if op.name in COMM_OPS else StageTime(compute_s=t))
        return out

    if c == 0:  # F: x's forward, with its FP8 casts
        stages = [StageTime(compute_s=extra("fp8").forward_extra_s), *ops(reverse=False)]
    elif c == 1:  # B: y's backward, with its casts back
        stages = [*ops(reverse=True), StageTime(compute_s=extra("fp8").backward_extra_s)]
    elif c == 2:  # O: x-1's offload copies
        stages = [StageTime(copy_s=extra("offload").forward_extra_s)]
    else:  # R: y+1's reloads, then its recompute
        recovery = (extra("offload").backward_extra_s, extra("recompute").backward_extra_s)
        stages = [StageTime(copy_s=recovery[0]), StageTime(compute_s=recovery[1])]
    return _compact(stages)


def point_stages(
    cm: CostModel | Sequence[CostModel],
    forward: Mapping[OpId, str],
    backward: Mapping[OpId, str],
    offload: Mapping[OpId, str],
    recovery: Mapping[OpId, str],
    tokens: int,
    routed: Routed = None,
    seq_len: int | None = None,
    options: MitigationOptions = MitigationOptions(),
) -> list[list[list[StageTime]]]:
    """The stages of a steady scheduling point F_x B_y from the cost model, each micro-batch under
    its plan (all of `tokens` and `routed`), block by block: element k holds the four classes'
    stages of their k-th block in execution order (§V-B solves one transformer block's few stages
    at a time, `solve_blocks`):
    - F: x's forward of block k, ops in program order (with FP8 casts), dispatch / combine on the
      copy stream;
    - B: y's backward of the k-th block from the last, ops in reverse (with FP8 casts back), its
      all-to-alls on the copy stream;
    - O: x-1's offload copies of block k, on the copy stream;
    - R: y+1's recovery of the k-th block from the last: its reloads (copy stream), then its
      recompute (compute stream).
    Consecutive work on one stream is one stage (compaction at the communication ops). `cm` is
    the stage's cost model, or one per class (F, B, O, R) when the four run different model
    chunks (interleaved 1F1B); a chunk with fewer blocks gives empty stages at the end."""
    models = (cm,) * len(CLASSES) if isinstance(cm, CostModel) else tuple(cm)
    if len(models) != len(CLASSES):
        raise ValueError(f"give one cost model, or one per class {CLASSES}, got {len(models)}")
    loads = [model.loads(Forward(tokens, seq_len, routed)) for model in models]
    plans = [Plan(plan) for plan in (forward, backward, offload, recovery)]
    return [
        [
            _class_stages(c, model, load, plan.block(i) if i is not None else (), i, options)
            for c, (model, load, plan, i) in enumerate(zip(models, loads, plans, blocks))
        ]
        for blocks in _positions(models)
    ]


def solve_blocks(blocks: Sequence[Stages]) -> Schedule:
    """A scheduling point solved one block at a time (`point_stages`' entriess) and joined: the
    windows never cross a block boundary, which keeps each DP at a few stages per class."""
    return _joined([(solve(stages), tuple(len(run) for run in stages)) for stages in blocks])


def _joined(parts: Sequence[tuple[Schedule, tuple[int, ...]]]) -> Schedule:
    """Blocks' schedules, each with its classes' stage counts, as one point's: windows shifted by
    the stages of the blocks before."""
    total, serial, windows, offsets = 0.0, 0.0, [], [0] * len(CLASSES)
    for part, sizes in parts:
        total, serial = total + part.time_s, serial + part.serial_s
        windows += [tuple((a + o, b + o) for (a, b), o in zip(w, offsets)) for w in part.windows]
        offsets = [o + n for o, n in zip(offsets, sizes)]
    return Schedule(total, tuple(windows), serial)


def piece_stages(blocks: Sequence[Stages]) -> list[list[list[StageTime]]]:
    """`point_stages`' blocks at the granularity an executor runs them (`_piece`)."""
    return [[_piece(c, run) for c, run in enumerate(stages)] for stages in blocks]


def _piece(c: int, run: Sequence[StageTime]) -> list[StageTime]:
    """Class c's stages of one block as an executor runs them: F and B one stage each (a block's
    forward or backward is one autograd piece; its all-to-alls run inside it, their time on the
    copy stream), O one stage (x-1's copies), R two, its reloads then its recompute (an executor
    issues them apart, so the copies can run under other work)."""
    merged = StageTime(sum(s.compute_s for s in run), sum(s.copy_s for s in run))
    return [merged] if c < 3 else [StageTime(copy_s=merged.copy_s), StageTime(compute_s=merged.compute_s)]


def joined(blocks: Sequence[Stages]) -> list[list[StageTime]]:
    """The four classes' whole stage lists of a point given block by block."""
    return [[s for stages in blocks for s in stages[c]] for c in range(len(CLASSES))]


def _compact(stages: list[StageTime]) -> list[StageTime]:
    """Merge consecutive stages on the same stream; drop empty ones."""
    out: list[StageTime] = []
    for s in stages:
        if s.compute_s == 0 and s.copy_s == 0:
            continue
        stream = "compute" if s.copy_s == 0 else "copy"
        if out and ("compute" if out[-1].copy_s == 0 else "copy") == stream:
            out[-1] = StageTime(out[-1].compute_s + s.compute_s, out[-1].copy_s + s.copy_s)
        else:
            out.append(s)
    return out
