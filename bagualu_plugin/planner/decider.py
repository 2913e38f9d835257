"""The decisions of one pipeline rank's micro-batches (paper §V-A), numbers in and numbers out:
Algorithm 1's budget before each forward, Algorithm 2's plan for the normal routing band that
leaves each MoE gate the room it may need (`plan_for_gates`), each gate's fits / defer / escalate
once the layer's real routed pairs are known (`GatePlan.at_gate`), and the budget replaced by what
the forward really kept. The Provisioner drives it with the Ledger's bytes and the gates' real
pairs; the simulator (`sim.systems`) with the cost model's bytes and a routing trace: both decide
through this one class.

A rank may plan several cost models, one per `key`: the model chunks of interleaved 1F1B (§VI-A)
in the simulator, the kinds of forward a trainer runs (`runtime.boundaries.ForwardKind`) in the
Provisioner. Algorithm 2 runs per key as one lazily extended path of plans (`PathPlanner`),
answered in buckets of 1/16 of M0 and of the balanced routing; the gates' costs are kept per plan.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..costmodel.mitigation import MitigationOptions
from ..costmodel.model import CostModel
from ..costmodel.plan import Plan
from .gate import GateDecision, GatePlan, LayerCost, escalated, gate_costs, plan_for_gates
from .greedy import InfeasibleBudget, plan_micro_batch
from .path import PathPlanner

if TYPE_CHECKING:  # the stage is computed above the planner (its budgets are a BudgetState)
    from ..stage import Stage


@dataclass(frozen=True)
class Deferral:
    """A gate whose overrun the later warmup micro-batches' budgets absorb."""

    layer: int
    local_pairs: float
    overrun: float


@dataclass(frozen=True)
class Escalation:
    """A gate whose layer's routed experts are recomputed; `slack_after` is what is left then."""

    layer: int
    local_pairs: float
    overrun: float
    slack_after: float


@dataclass
class Forward:
    """The decisions of the micro-batch whose forward runs: made by `Decider.begin`, updated at
    each of its MoE gates by `Decider.at_gate`, closed by `Decider.end`."""

    k: int  # its forward in Algorithm 1's order (a chunk forward with vp > 1)
    budget: int
    gates: GatePlan  # the normal band's plan and what each gate weighs
    plan: Plan  # what it runs: the normal band's plan with the gates' escalations
    slack: float  # bytes it may still add under its budget
    headroom: float  # bytes later warmup micro-batches can still give up
    balanced: float  # local routed pairs per MoE layer under balanced routing
    routed: dict[int, float] = field(default_factory=dict)  # local routed pairs at each gate so far
    deferred: list[Deferral] = field(default_factory=list)
    escalations: list[Escalation] = field(default_factory=list)


class Decider:
    """One rank's Algorithm 1 state and its Algorithm 2 and gate decisions (§V-A). `stage`: the
    rank's numbers (capacity, static bytes, M0, warmup depth, routing band, strategies); `costs`:
    the cost model of each key (default: the stage's own under the key None)."""

    def __init__(self, stage: Stage, costs: dict[Hashable, CostModel] | None = None):
        self.costs: dict[Hashable, CostModel] = dict(costs) if costs is not None else {None: stage.cost}
        self._planners: dict[Hashable, PathPlanner] = {}
        self._gates: dict[tuple, dict[int, LayerCost]] = {}
        self._escalated: dict[tuple[Plan, int], Plan] = {}  # one Plan per escalation: caches of plans hit by identity
        self._quanta = (0, 0)
        self._use(stage)
        self.budgets = self.first.copy()

    def set_stage(self, stage: Stage) -> None:
        """Decide for `stage` from now on (its static bytes re-measured, or a larger M0 for a larger
        micro-batch): Algorithm 1 from its numbers, which checks that M0 fits (a ValueError with
        the numbers otherwise); the running iteration keeps its micro-batches' budgets, its used
        bytes moved by the static bytes' change. Plans made stay cached unless the planner's
        buckets move with M0 or the tokens."""
        moved = stage.static_bytes - self.stage.static_bytes
        self._use(stage)
        self.budgets.min_budget, self.budgets.used = self.first.min_budget, self.budgets.used + moved

    def _use(self, stage: Stage) -> None:
        self.stage, self.first = stage, stage.budgets()
        spikes = stage.recipe.spikes
        self.normal, self.heaviest = spikes.normal_max_imbalance, spikes.spike_max_imbalance
        self.strategies, self.options = stage.recipe.strategies.allowed, stage.options
        quanta = (max(1, stage.min_budget // 16), max(1, int(stage.tokens * stage.cost.pairs_per_token) // 16))
        if quanta != self._quanta:
            self._quanta, self._planners = quanta, {}

    def add(self, key: Hashable, cost: CostModel) -> None:
        """Plan micro-batches of `key` on `cost`."""
        self.costs[key] = cost

    def start_iteration(self, held: int = 0) -> None:
        """Algorithm 1 starts over: nothing of the last iteration is live but `held` bytes (graphs
        left from before, which no budget gives back)."""
        self.budgets = self.first.copy()
        self.budgets.used += held

    def begin(self, k: int, tokens: int, seq_len: int | None, key: Hashable = None) -> Forward:
        """Forward k's budget and its plan for the normal band, for `tokens` tokens of `key`."""
        budget = self.budgets.budget(k)
        cm = self.costs[key]
        balanced = tokens * cm.pairs_per_token
        planned, planner = balanced * self.normal, self._planner(key)
        routed = [planned] * len(cm.moe_layers)
        gates = plan_for_gates(
            lambda b: planner.plan(b, tokens, routed, seq_len), lambda plan: self._gate_costs(key, plan, tokens, seq_len, planned),
            budget, planned, balanced * self.heaviest,
        )
        return Forward(k, budget, gates, gates.decision.plan, gates.slack, self.budgets.headroom(k), balanced)

    def at_gate(self, f: Forward, layer: int, pairs: float) -> GateDecision:
        """Deferred planning: `pairs` local routed pairs reached `layer`'s experts, which have not
        run yet; an escalation recomputes them (`f.plan` then says so)."""
        f.routed[layer] = pairs
        decision = f.gates.at_gate(layer, pairs, f.slack, f.headroom)
        f.slack, f.headroom = decision.slack, decision.headroom
        if decision.action == "defer":
            f.deferred.append(Deferral(layer, pairs, decision.overrun))
        elif decision.action == "escalate":
            up = self._escalated.get((f.plan, layer))
            if up is None:
                up = self._escalated[f.plan, layer] = escalated(f.plan, layer)
            f.plan = up
            f.escalations.append(Escalation(layer, pairs, decision.overrun, decision.slack))
        return decision

    def end(self, f: Forward, actual: int) -> None:
        """Forward `f` kept `actual` bytes (its reload room included): its budget becomes that."""
        self.budgets.record(f.k, actual)

    def _planner(self, key: Hashable) -> PathPlanner:
        planner = self._planners.get(key)
        if planner is None:
            budget_q, routed_q = self._quanta
            planner = self._planners[key] = PathPlanner(self.costs[key], budget_q, routed_q, self.strategies, self.options)
        return planner

    def _gate_costs(self, key: Hashable, plan: Plan, tokens: int, seq_len: int | None, planned: float) -> dict[int, LayerCost]:
        memo = (key, plan, tokens, seq_len)
        costs = self._gates.get(memo)
        if costs is None:  # as few as the planner's cached decisions
            costs = self._gates[memo] = gate_costs(self.costs[key], plan, tokens, seq_len, planned, self.options)
        return costs


def static_plan(
    cm: CostModel, budget: float, tokens: int, seq_len: int | None, routed: float, strategies: Sequence[str] | None,
    options: MitigationOptions = MitigationOptions(),
) -> Plan:
    """A static policy's one plan for every micro-batch (§II-B's static workflow): Algorithm 2 of
    `strategies` at `budget` for `routed` local pairs per MoE layer; full recompute where
    `strategies` is None or nothing they make fits, what a static tuner falls back to."""
    if strategies is None:
        return Plan(cm.full_recompute())
    try:
        return plan_micro_batch(cm, budget, tokens, [routed] * len(cm.moe_layers), seq_len, strategies, options).plan
    except InfeasibleBudget:
        return Plan(cm.full_recompute())
