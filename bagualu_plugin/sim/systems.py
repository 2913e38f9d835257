"""The systems a simulation compares (paper §VI-A, §II-B), each a way to choose every micro-batch's
plan on every pipeline rank; `iteration(it)` gives each rank's micro-batch costs under the trace.

- `bagualu`: BaGuaLu-2 as the Provisioner runs it (§V): per micro-batch Algorithm 1 budgets
  (`planner.BudgetState`), Algorithm 2 plans for the normal routing band (`planner.CachedPlanner`),
  deferred planning at each MoE gate (`planner.at_gate`, `gate_costs`, `escalated`), and each
  steady F_x B_y point fused as §V-B's DP orders it (`planner.dual_batch`: its forward and backward
  take fused / serial of their serial time).
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
from dataclasses import dataclass, replace

from ..config import Recipe
from ..costmodel import OpId
from ..costmodel.pipeline import fused_points
from ..costmodel.plan import Plan
from ..planner import BudgetState, CachedPlanner, InfeasibleBudget, LayerCost, at_gate, escalated, gate_costs, plan_micro_batch
from ..planner.dual_batch import ScheduleCache, executor_stages
from ..stage import Stage
from .costs import MicroBatch, PlanCosts, StageCosts
from .trace import Trace

SYSTEMS = ("bagualu", "adapipe_like", "megatron_kuai_like", "static_under", "full_recompute")


@dataclass(frozen=True)
class Rank:
    """One pipeline rank: its stage, its memoised costs and where its MoE layers are in the trace."""

    stage: Stage
    costs: StageCosts
    positions: tuple[int, ...]

    @property
    def first_budgets(self) -> BudgetState:
        s = self.stage
        return BudgetState.start(s.capacity, s.static_bytes, s.min_budget, s.warmup)


def ranks(recipe: Recipe, trace: Trace) -> list[Rank]:
    """Every rank of the recipe's pipeline."""
    out = []
    for r in range(recipe.pipeline.pp):
        stage = Stage.of(recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"rank": r})}))
        out.append(Rank(stage, StageCosts(stage), trace.positions(stage.cost.moe_layers)))
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

    def _plans(self, strategies: Sequence[str] | None, imbalance: float) -> list[PlanCosts]:
        return [r.costs.under(static_plan(r, strategies, imbalance)) for r in self.ranks]

    def iteration(self, it: int) -> list[list[MicroBatch]]:
        micro_batches = range(len(self.trace.imbalance[it]))
        return [[costs.at(self.trace.of(it, mb, r.positions)) for mb in micro_batches] for r, costs in zip(self.ranks, self.plans)]

    def after_crash(self, observed: float) -> bool:
        if self.fallback is None:
            return False
        before = [c.plan for c in self.plans]
        self.plans = self._plans(self.strategies if self.fallback == "observed" else None, observed)
        return [_items(c.plan) for c in self.plans] != [_items(p) for p in before]


def static_plan(rank: Rank, strategies: Sequence[str] | None, imbalance: float) -> Plan:
    """Algorithm 2's plan (of `strategies`; None: full recompute) for routing `imbalance` x
    balanced at the stage's first Algorithm 1 budget, the even share of the warmup stack."""
    s = rank.stage
    if strategies is None:
        return Plan(s.cost.full_recompute())
    routed = [rank.costs.balanced * imbalance] * len(s.cost.moe_layers)
    try:
        return plan_micro_batch(s.cost, rank.first_budgets.budget(0), s.tokens, routed, s.recipe.batch.seq_len, strategies, s.options).plan
    except InfeasibleBudget:
        return Plan(s.cost.full_recompute())


class BaGuaLu(System):
    """BaGuaLu-2 (§V): what the Provisioner decides per micro-batch, and §V-B's fused points
    (`fused=False`: without them, the ablation's L3). `decision_s` holds, per iteration, the
    slowest rank's decision time (budgets, plans, gates, schedules: §VI-D's runtime overhead)."""

    def __init__(self, ranks: Sequence[Rank], trace: Trace, fused: bool = True, name: str = "bagualu"):
        self.name, self.ranks, self.trace = name, list(ranks), trace
        self._deciders = [_Decider(r, fused) for r in self.ranks]
        self.decision_s: list[float] = []

    def iteration(self, it: int) -> list[list[MicroBatch]]:
        out, slowest = [], 0.0
        for d in self._deciders:
            start = time.perf_counter()
            out.append(d.iteration(self.trace, it))
            slowest = max(slowest, time.perf_counter() - start)
        self.decision_s.append(slowest)
        return out


class _Decider:
    """One rank's Provisioner arithmetic (`runtime.provisioner`), without a model."""

    def __init__(self, rank: Rank, fused: bool = True):
        s = self.stage = rank.stage
        self.rank, self.first = rank, rank.first_budgets
        balanced = rank.costs.balanced
        self.planned = balanced * s.recipe.spikes.normal_max_imbalance
        self.planner = CachedPlanner(  # the Provisioner's cache buckets: 1/16 of M0 and of the balanced routing
            s.cost, budget_quantum=max(1, s.min_budget // 16), routed_quantum=max(1, int(balanced) // 16),
            strategies=s.recipe.strategies.allowed, options=s.options,
        )
        self.gates: dict[tuple, dict[int, LayerCost]] = {}
        self.schedules = ScheduleCache(executor_stages(s.cost, s.options)) if fused and s.recipe.pipeline.pp > 2 else None
        self.points = _points(s)

    def iteration(self, trace: Trace, it: int) -> list[MicroBatch]:
        s, costs = self.stage, self.rank.costs
        seq_len = s.recipe.batch.seq_len
        budgets, plans, out = self.first, [], []
        for mb in range(s.recipe.pipeline.micro_batches):
            imbalance = trace.of(it, mb, self.rank.positions)
            plan = self._plan(budgets, mb, imbalance)
            cost = costs.under(plan).at(imbalance)
            budgets = budgets.after_forward(mb, round(cost.held_bytes))
            plans.append(plan)
            out.append(cost)
        if self.schedules is not None:
            for x, y in self.points:
                key = (s.tokens, seq_len, *(_items(plans[mb]) for mb in (x, y, x - 1)), _items(plans[y + 1]) if y + 1 < x - 1 else ())
                schedule = self.schedules.get(key)
                if schedule.serial_s > 0:
                    factor = schedule.time_s / schedule.serial_s
                    out[x] = replace(out[x], forward_s=out[x].forward_s * factor)
                    out[y] = replace(out[y], backward_s=out[y].backward_s * factor)
        return out

    def _plan(self, budgets: BudgetState, mb: int, imbalance: tuple[float, ...]) -> Plan:
        """Algorithm 2 for the normal band at Algorithm 1's budget, then each gate in layer order."""
        s = self.stage
        budget, headroom = budgets.budget(mb), budgets.headroom(mb)
        moe = s.cost.moe_layers
        decision = self.planner.plan(budget, s.tokens, [self.planned] * len(moe), s.recipe.batch.seq_len)
        key = _items(decision.plan)
        if key not in self.gates:
            self.gates[key] = gate_costs(s.cost, decision.plan, s.tokens, s.recipe.batch.seq_len, self.planned, s.options)
        layer_costs, plan = self.gates[key], decision.plan
        slack = budget - decision.activation_bytes - decision.reload_bytes
        for layer, x in zip(moe, imbalance):
            pairs, c = self.rank.costs.balanced * x, layer_costs[layer]
            gate = at_gate(pairs, self.planned, c.per_pair, c.escalation_bytes(pairs, self.planned), slack, headroom)
            slack, headroom = gate.slack, gate.headroom
            if gate.action == "escalate":
                plan = escalated(plan, layer)
        return plan


def _points(stage: Stage) -> list[tuple[int, int]]:
    """The fused points (x, y) of a rank's 1F1B order, as the executor runs them."""
    return [(f.micro_batch, b.micro_batch) for f, b in fused_points(stage.schedule) if b is not None]


def _items(plan: Plan) -> tuple[tuple[OpId, str], ...]:
    return tuple(sorted(plan.items()))


LEVELS = ("L1", "L2", "L3", "L4")


def ablation(recipe: Recipe, trace: Trace) -> list[System]:
    """Fig. 11's levels, each adding one of BaGuaLu-2's parts (§VI-D), none of which crashes:
    L1 the coarse, layer-level policy (every layer recomputed); L2 static fine-grained mitigation,
    one Algorithm 2 plan per stage for the trace's worst routing; L3 dynamic mitigation (budgets,
    plans per micro-batch, the gate); L4 with the fused dual-batch points."""
    rs = ranks(recipe, trace)
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
