"""The systems a simulation compares (paper §VI-A, §II-B), each a way to choose every micro-batch's
plan on every pipeline rank; `iteration(it)` gives each rank's micro-batch costs under the trace.

- `bagualu`: BaGuaLu-2 as the Provisioner runs it (§V), through the same `planner.decider.Decider`:
  per micro-batch Algorithm 1 budgets, Algorithm 2 plans for the normal routing band, deferred
  planning at each MoE gate, and each
  steady F_x B_y point fused as §V-B's DP orders it (`planner.dual_batch`: its forward and backward
  take fused / serial of their serial time). Under expert parallelism its forwards also pay the
  gates' agreement on the collective escalation, one small all-reduce per MoE layer.
- Static baselines, planned once per stage at the even share of what static memory leaves to the
  warmup stack (Algorithm 1's first budget) for the normal band's routing (the "balanced load"
  that 97.1% of iterations stay within, §II-B), never changed until a crash: `adapipe_like`
  (recompute only, AdaPipe's adaptive recomputation), `megatron_kuai_like` (offload only) and
  `static_under` (every strategy: the best static fine-grained plan, Fig. 1's under-provisioning).
  After an out-of-memory crash (§VI-A) AdaPipe and Megatron-Kuai are re-planned for the
  imbalance observed in the crashed iteration; static_under falls back to full recompute (Fig. 1).
- `full_recompute`: every micro-batch fully recomputed (M0, Fig. 1's over-provisioning).
A plan Algorithm 2 cannot fit in the budget is full recompute, what a static tuner falls back to.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..config import Recipe
from ..costmodel.pipeline import Step, fused_points
from ..costmodel.plan import Plan
from ..planner.decider import Decider, static_plan
from ..planner.dual_batch import ScheduleCache
from ..stage import Stage
from .costs import MicroBatch, PlanCosts, StageCosts
from .trace import Trace

SYSTEMS = ("bagualu", "adapipe_like", "megatron_kuai_like", "static_under", "full_recompute")


@dataclass(frozen=True)
class Rank:
    """One pipeline rank: its stage and, per model chunk (one without interleaving), the chunk's
    memoised costs and where its MoE layers are in the trace. Its micro-batch costs are listed
    as the simulation's are, chunk c of micro-batch mb at mb * vp + c."""

    stage: Stage
    costs: tuple[StageCosts, ...]
    positions: tuple[tuple[int, ...], ...]
    planners: dict = field(default_factory=dict, compare=False, repr=False)  # its deciders' path planners, shared

    def imbalance(self, trace: Trace, it: int, mb: int) -> list[tuple[float, ...]]:
        """Per chunk, the routing of its MoE layers in micro-batch `mb` of iteration `it`."""
        return [trace.of(it, mb, p) for p in self.positions]


def ranks(recipe: Recipe, trace: Trace) -> list[Rank]:
    """Every rank of the recipe's pipeline."""
    out = []
    for r in range(recipe.pipeline.pp):
        stage = Stage.of(recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"rank": r})}))
        chunks = [stage.chunk(c) for c in range(len(stage.chunks))]
        out.append(Rank(stage, tuple(StageCosts(c) for c in chunks), tuple(trace.positions(c.cost.moe_layers) for c in chunks)))
    return out


class System:
    """A way to plan micro-batches; `iteration(it)[r][mb]` is micro-batch mb's cost on rank r."""

    name: str

    def iteration(self, it: int) -> list[list[MicroBatch]]:
        raise NotImplementedError

    def after_crash(self, observed: float) -> bool:
        """An out-of-memory crash with `observed` peak imbalance: change the plan for the restart
        and say so (False: nothing would change)."""
        return False


class Static(System):
    """One plan per rank, replayed for every micro-batch (§II-B's static workflow)."""

    def __init__(
        self, name: str, ranks: Sequence[Rank], trace: Trace, strategies: Sequence[str] | None, fallback: str | None,
        imbalance: float | None = None,
    ):
        """`strategies`: what Algorithm 2 may use (None: full recompute); `fallback` after a crash:
        "observed" (re-planned for the observed imbalance), "full_recompute", or None (no change);
        `imbalance`: the routing planned for (default: the top of the normal band)."""
        self.name, self.ranks, self.trace = name, list(ranks), trace
        self.strategies, self.fallback = strategies, fallback
        self.plans = self._plans(strategies, imbalance or ranks[0].stage.recipe.spikes.normal_max_imbalance)

    def _plans(self, strategies: Sequence[str] | None, imbalance: float) -> list[list[PlanCosts]]:
        return [[c.under(_static_plan(c, r.stage, strategies, imbalance)) for c in r.costs] for r in self.ranks]

    def iteration(self, it: int) -> list[list[MicroBatch]]:
        micro_batches = range(len(self.trace.imbalance[it]))
        return [
            [costs.at(x) for mb in micro_batches for costs, x in zip(plans, r.imbalance(self.trace, it, mb))]
            for r, plans in zip(self.ranks, self.plans)
        ]

    def after_crash(self, observed: float) -> bool:
        if self.fallback is None:
            return False
        before = [[c.plan.key for c in plans] for plans in self.plans]
        self.plans = self._plans(self.strategies if self.fallback == "observed" else None, observed)
        return [[c.plan.key for c in plans] for plans in self.plans] != before


def _static_plan(costs: StageCosts, rank: Stage, strategies: Sequence[str] | None, imbalance: float) -> Plan:
    """The static plan of one model chunk (`costs`; the rank's blocks without interleaving) for
    routing `imbalance` x balanced at the rank's first Algorithm 1 budget, the even share of the
    warmup stack."""
    s, budget = costs.stage, rank.budgets().budget(0)
    return static_plan(s.cost, budget, s.tokens, s.recipe.batch.seq_len, costs.balanced * imbalance, strategies, s.options)


class BaGuaLu(System):
    """BaGuaLu-2 (§V): what the Provisioner decides per micro-batch, and §V-B's fused points
    (`fused=False`: without them, the ablation's L3). `decision_s` holds, per iteration, the
    slowest rank's decision time (budgets, plans, gates, schedules: §VI-D's runtime overhead; not
    the simulation's own pricing of what the decisions keep, which a real run measures)."""

    def __init__(self, ranks: Sequence[Rank], trace: Trace, fused: bool = True, name: str = "bagualu"):
        self.name, self.ranks, self.trace = name, list(ranks), trace
        self._deciders = [_Decider(r, fused) for r in self.ranks]
        self.decision_s: list[float] = []
        self.decision_forward_s: list[float] = []  # per chunk forward, in order: the slowest rank's budget, plan and gates

    def iteration(self, it: int) -> list[list[MicroBatch]]:
        out, spent, forwards = zip(*(d.iteration(self.trace, it) for d in self._deciders))
        self.decision_s.append(max(spent))
        self.decision_forward_s.extend(map(max, zip(*forwards)))
        return list(out)


class _Decider:
    """One rank's decisions (`planner.decider.Decider`, as the Provisioner makes them), driven by
    the trace and the cost model's bytes instead of a model; with vp > 1 every chunk forward is one
    Algorithm 1 step, planned on its chunk's cost model (the decider's key is the chunk).

    Under expert parallelism the Provisioner's gate, at every MoE layer with a collective
    escalation, asks the group whether any rank escalates it (`parallel.expert.any_rank`: §V-A's
    deferred planning as one decision of the group), whatever this rank decides. So each chunk
    forward pays one small all-reduce per such layer (`HardwareSpec.all_reduce_s`), added after
    the fused points' overlap: the host waits on each answer before the layer's experts run."""

    def __init__(self, rank: Rank, fused: bool = True):
        s = self.stage = rank.stage
        self.rank, self.vp = rank, len(rank.costs)
        self.decider = Decider(s, {c: costs.cm for c, costs in enumerate(rank.costs)}, rank.planners)
        self.schedules = ScheduleCache(s.chunks, s.options) if fused and s.recipe.pipeline.pp > 2 else None
        self.forwards = [(f.micro_batch, f.chunk) for f in s.schedule if f.kind == "F"]
        self.moe_layers = [costs.cm.moe_layers for costs in rank.costs]
        self.points = _points(s.schedule)
        agreement_s = s.recipe.hardware.all_reduce_s(s.recipe.parallel.ep)
        self.agreement_s = [agreement_s * sum(bool(costs.cm.blocks[i].collective) for i in costs.cm.moe_layers) for costs in rank.costs]

    def iteration(self, trace: Trace, it: int) -> tuple[list[MicroBatch], float, list[float]]:
        """The rank's micro-batch costs in iteration `it`, the seconds its decisions took, and those
        of each forward's budget, plan and gates."""
        s, vp, decider = self.stage, self.vp, self.decider
        seq_len = s.recipe.batch.seq_len
        plans, spent, forwards = {}, 0.0, []
        out: list[MicroBatch | None] = [None] * len(self.forwards)
        start = time.perf_counter()
        decider.start_iteration()
        spent += time.perf_counter() - start
        for k, (mb, c) in enumerate(self.forwards):
            imbalance = trace.of(it, mb, self.rank.positions[c])  # the routing the gates will see
            start = time.perf_counter()
            f = decider.begin(k, s.tokens, seq_len, c)
            for layer, x in zip(self.moe_layers[c], imbalance):
                decider.at_gate(f, layer, f.balanced * x)
            forwards.append(time.perf_counter() - start)
            spent += forwards[-1]
            cost = self.rank.costs[c].under(f.plan).at(imbalance)  # what the Ledger would measure
            start = time.perf_counter()
            decider.end(f, round(cost.held_bytes))
            spent += time.perf_counter() - start
            plans[mb, c] = f.plan
            out[mb * vp + c] = cost
        if self.schedules is not None:
            for (x, y, o, r) in self.points:
                start = time.perf_counter()
                which = tuple(unit[1] if unit else 0 for unit in (x, y, o, r))
                schedule, _ = self.schedules.get(s.tokens, seq_len, which, [plans[unit] if unit else None for unit in (x, y, o, r)])
                spent += time.perf_counter() - start
                if schedule.serial_s > 0:
                    factor = schedule.time_s / schedule.serial_s
                    fx, by = x[0] * vp + x[1], y[0] * vp + y[1]
                    out[fx] = replace(out[fx], forward_s=out[fx].forward_s * factor)
                    out[by] = replace(out[by], backward_s=out[by].backward_s * factor)
        return [replace(m, forward_s=m.forward_s + self.agreement_s[u % vp]) for u, m in enumerate(out)], spent, forwards


Unit = tuple[int, int]  # (micro-batch, chunk)


def _points(schedule: list[Step]) -> list[tuple[Unit, Unit, Unit | None, Unit | None]]:
    """The fused points of a rank's order as the executor runs them, each with its four classes'
    units (§V-B): F's x, B's y, O's x-1 (the forward before x) and R's y+1 (the backward after y,
    when it was forwarded before x-1, so its recovery does not touch O's copies; else None)."""
    forwards = [(s.micro_batch, s.chunk) for s in schedule if s.kind == "F"]
    backwards = [(s.micro_batch, s.chunk) for s in schedule if s.kind == "B"]
    position = {unit: k for k, unit in enumerate(forwards)}
    out = []
    for f, b in fused_points(schedule):
        if b is None:
            continue
        x, y = (f.micro_batch, f.chunk), (b.micro_batch, b.chunk)
        i, j = position[x], backwards.index(y)
        o = forwards[i - 1] if i else None
        r = backwards[j + 1] if j + 1 < len(backwards) and o is not None and position[backwards[j + 1]] < i - 1 else None
        out.append((x, y, o, r))
    return out


LEVELS = ("L1", "L2", "L3", "L4")


def ablation(recipe: Recipe, trace: Trace, rs: Sequence[Rank] | None = None) -> list[System]:
    """Fig. 11's levels, each adding one of BaGuaLu-2's parts (§VI-D), none of which crashes:
    L1 the coarse, layer-level policy (every layer recomputed); L2 static fine-grained mitigation,
    one Algorithm 2 plan per stage for the trace's worst routing; L3 dynamic mitigation (budgets,
    plans per micro-batch, the gate); L4 with the fused dual-batch points. `rs`: the recipe's
    ranks, if built already."""
    rs = rs or ranks(recipe, trace)
    worst = max(trace.peak(it) for it in range(trace.iterations))
    return [
        Static("L1", rs, trace, None, None),
        Static("L2", rs, trace, recipe.strategies.allowed, "full_recompute", imbalance=worst),
        BaGuaLu(rs, trace, fused=False, name="L3"),
        BaGuaLu(rs, trace, name="L4"),
    ]


def systems(recipe: Recipe, trace: Trace) -> list[System]:
    """The five systems of `SYSTEMS`, over the same ranks (their costs memoised once)."""
    rs = ranks(recipe, trace)
    allowed = recipe.strategies.allowed
    return [
        BaGuaLu(rs, trace),
        Static("adapipe_like", rs, trace, ["recompute"], "observed"),
        Static("megatron_kuai_like", rs, trace, ["offload"], "observed"),
        Static("static_under", rs, trace, allowed, "full_recompute"),
        Static("full_recompute", rs, trace, None, None),
    ]
