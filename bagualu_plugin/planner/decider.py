"""The decisions of one pipeline rank's micro-batches (paper §V-A), numbers in and numbers out:
Algorithm 1's budget before each forward, Algorithm 2's plan for the normal routing band that
leaves each MoE gate the room it may need (`plan_for_gates`), each gate's fits / defer / escalate
once the layer's real routed pairs are known (`GatePlan.at_gate`), and the budget replaced by what
the forward really kept. The Provisioner drives it with the Ledger's bytes and the gates' real
pairs; the simulator (`sim.systems`) with the cost model's bytes and a routing trace: both decide
through this one class.

A rank may plan several cost models, one per `key`: the model chunks of interleaved 1F1B (§VI-A)
in the simulator, the kinds of forward a trainer runs (`costmodel.ForwardKind`) in the
Provisioner. Each key's plans come from one `PathPlanner`, whatever the shape: a few paths of
Algorithm 2 computed on forms of the shape, answered in buckets of 1/16 of M0 and of the balanced
routing, with each plan's gates read off forms too. A trainer that pads each micro-batch to its
longest text brings a new shape almost every time; its decisions stay products of forms and
lookups, never a new greedy (`Band`: one key's micro-batches of one shape).

A micro-batch whose routing is known before its forward (`Foresight`: an oracle's, which ran the
forward once to record it) is planned by Algorithm 2 for that routing instead: the limit of
what deferred planning can reach, a benchmark's reference.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..costmodel.graph import COLLECTIVE_OPS, EXPERT_OPS
from ..costmodel.mitigation import MitigationOptions
from ..costmodel.model import CostModel
from ..costmodel.plan import Plan
from .gate import GateDecision, GatePlan, escalated, plan_for_gates
from .greedy import InfeasibleBudget, plan_micro_batch
from .path import PathPlanner

BANDS_KEPT = 64  # shapes whose bands a Decider keeps (each with a few plans' gates)
GATES_KEPT = 8  # plans whose gates a band keeps
PREPARED_KEPT = 64  # plans a Decider remembers handing to `on_plan`

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
    """A gate whose layer's routed experts are recomputed (`collective`: with their all-to-alls, on
    every rank of the expert-parallel group); `slack_after` is what is left then."""

    layer: int
    local_pairs: float
    overrun: float
    slack_after: float
    collective: bool = False


@dataclass
class Decisions:
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


class Band:
    """The normal routing band of one key's micro-batches of one shape (tokens, seq_len): the
    routing its plans are made for, and the gates of each plan it served, kept for the plans its
    micro-batches come back to (a few: `GATES_KEPT`). Its plans and gates come from the key's
    `PathPlanner`, which serves every shape. `planned` and `heaviest`: local routed pairs per MoE
    layer at the top of the normal band (rounded up to the planner's quantum) and at
    `spike_max_imbalance`."""

    def __init__(self, planner: PathPlanner, tokens: int, seq_len: int | None, normal: float, heaviest: float):
        cm = planner.cm
        self.balanced = tokens * cm.pairs_per_token
        self.moe_layers = cm.moe_layers
        self._planner, self._key = planner, planner.key(tokens, [self.balanced * normal] * len(self.moe_layers), seq_len)
        self.planned, self.heaviest = max(self._key[2], default=0.0), self.balanced * heaviest
        self._gates: OrderedDict[Plan, GatePlan] = OrderedDict()
        self._answers: OrderedDict[float, tuple[GatePlan, bool]] = OrderedDict()
        self.on_plan: Callable[[GatePlan], None] | None = None

    def plan(self, budget: float) -> tuple[GatePlan, bool]:
        """Algorithm 2's plan for `budget` with its gates, and whether it fits (else the most it
        saves): the answers of the last budgets (in the planner's buckets) kept."""
        floor = budget // self._planner.budget_quantum
        answer = self._answers.get(floor)
        if answer is None:
            served = self._planner.find(self._key, budget)
            plan = served.decision.plan
            gates = self._gates.get(plan)
            if gates is None:
                gates = self._gates[plan] = self._planner.gates(served, self.planned, self.heaviest)
                while len(self._gates) > GATES_KEPT:
                    self._gates.popitem(last=False)
                if self.on_plan is not None:
                    self.on_plan(gates)
            elif gates.decision != served.decision:
                gates = replace(gates, decision=served.decision)  # the same plan, its numbers as served now
            self._gates.move_to_end(plan)
            answer = self._answers[floor] = gates, served.fits
            while len(self._answers) > GATES_KEPT:
                self._answers.popitem(last=False)
        self._answers.move_to_end(floor)
        return answer


class Foresight:
    """A micro-batch's local routed pairs per MoE layer, known before its forward, answered by
    Algorithm 2 for that routing (on a planner of its own, dropped with it). Its gates plan for
    the routing known: they leave no room for a spike, and one escalates only where no plan fits
    the budget."""

    def __init__(self, band: Band, routed: Mapping[int, float]):
        missing = [layer for layer in band.moe_layers if layer not in routed]
        if missing:
            raise ValueError(f"routed: no local routed pairs for MoE layers {missing}; got layers {sorted(routed)}")
        source = band._planner
        self._planner = PathPlanner(source.cm, source.budget_quantum, source.routed_quantum, source.strategies, source.options)
        tokens, seq_len, _ = band._key
        self._key = self._planner.key(tokens, [routed[layer] for layer in band.moe_layers], seq_len)
        self._planned = dict(zip(band.moe_layers, map(float, self._key[2])))  # each layer's pairs, rounded up as planned

    def plan(self, budget: float) -> tuple[GatePlan, float]:
        """The plan for `budget` (Algorithm 2's, or the most it can save where none fits) with its
        gates, and its slack."""
        served = self._planner.find(self._key, budget)
        d = served.decision
        return self._planner.gates(served, self._planned, self._planned), budget - d.activation_bytes - d.room_bytes


class Decider:
    """One rank's Algorithm 1 state and its Algorithm 2 and gate decisions (§V-A). `stage`: the
    rank's numbers (capacity, static bytes, M0, warmup depth, routing band, strategies); `costs`:
    the cost model of each key (default: the stage's own under the key None); `planners`: the
    `PathPlanner` of each key, shared by the deciders of one stage (the simulator's systems decide
    on the same ranks); `on_plan`: called with each plan a band serves for the first time, and its
    gates (the Provisioner validates its regions and its escalations' then, before any forward
    runs it). Bands are kept for the shapes seen last (`BANDS_KEPT`), plans for every shape."""

    def __init__(
        self, stage: Stage, costs: dict[Hashable, CostModel] | None = None, planners: dict | None = None,
        on_plan: Callable[[GatePlan], None] | None = None,
    ):
        self.costs: dict[Hashable, CostModel] = dict(costs) if costs is not None else {None: stage.cost}
        self._planners: dict[Hashable, PathPlanner] = {} if planners is None else planners
        self._bands: OrderedDict[tuple, Band] = OrderedDict()
        self._on_plan = on_plan
        self._prepared: OrderedDict[Plan, None] = OrderedDict()  # the last plans handed to on_plan
        self._quanta = (0, 0)
        self._use(stage)
        self.budgets = self.first.copy()

    def set_stage(self, stage: Stage) -> None:
        """Decide for `stage` from now on (its static bytes re-measured, or a larger M0 for a larger
        micro-batch): Algorithm 1 from its numbers, which checks that M0 fits (a ValueError with
        the numbers otherwise); the running iteration keeps its micro-batches' budgets, its used
        bytes moved by the static bytes' change. The planners' paths stay: they serve any shape."""
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
            self._quanta = quanta
            self._bands.clear()  # their routing was rounded to the old quantum
            for planner in self._planners.values():
                planner.budget_quantum, planner.routed_quantum = quanta

    def add(self, key: Hashable, cost: CostModel) -> None:
        """Plan micro-batches of `key` on `cost` from now on (the paths and bands made on an earlier one go)."""
        self.costs[key] = cost
        self._planners.pop(key, None)
        for band in [band for band in self._bands if band[0] == key]:
            del self._bands[band]

    def planner(self, key: Hashable) -> PathPlanner:
        """The `PathPlanner` of `key`'s micro-batches (made on first use)."""
        planner = self._planners.get(key)
        if planner is None or planner.cm is not self.costs[key]:
            planner = self._planners[key] = PathPlanner(self.costs[key], *self._quanta, self.strategies, self.options)
        return planner

    def band(self, key: Hashable, tokens: int, seq_len: int | None) -> Band:
        """The normal band of `key`'s micro-batches of `tokens` tokens (made on first use)."""
        band = self._bands.get((key, tokens, seq_len))
        if band is None:
            band = self._bands[key, tokens, seq_len] = Band(self.planner(key), tokens, seq_len, self.normal, self.heaviest)
            band.on_plan = None if self._on_plan is None else self._prepare
            while len(self._bands) > BANDS_KEPT:
                self._bands.popitem(last=False)
        self._bands.move_to_end((key, tokens, seq_len))
        return band

    def _prepare(self, gates: GatePlan) -> None:
        """`on_plan` for a plan it has not seen lately: what it checks depends on the plan alone."""
        plan = gates.decision.plan
        if plan not in self._prepared:
            self._on_plan(gates)
            self._prepared[plan] = None
            while len(self._prepared) > PREPARED_KEPT:
                self._prepared.popitem(last=False)
        self._prepared.move_to_end(plan)

    def start_iteration(self, held: int = 0) -> None:
        """Algorithm 1 starts over: nothing of the last iteration is live but `held` bytes (graphs
        left from before, which no budget gives back)."""
        self.budgets = self.first.copy()
        self.budgets.used += held

    def foresee(self, tokens: int, seq_len: int | None, routed: Mapping[int, float], key: Hashable = None) -> Foresight:
        """A forward of `tokens` tokens of `key` whose local routed pairs per MoE layer are known
        ahead (`routed`), prepared for `begin`."""
        return Foresight(self.band(key, tokens, seq_len), routed)

    def begin(
        self, k: int, tokens: int, seq_len: int | None, key: Hashable = None, foresight: Foresight | None = None,
        held: int = 0,
    ) -> Decisions:
        """Forward k's budget and its plan for the normal band, for `tokens` tokens of `key`; with
        `foresight` (`foresee`'s, for the same micro-batch), its plan for the routing known.
        `held`: bytes the forward keeps beyond its cost model whatever the plan (token ids that
        are a view of a larger tensor): the plan fits what the budget leaves."""
        budget = self.budgets.budget(k) - held
        band = self.band(key, tokens, seq_len)
        if foresight is None:
            gates, slack = plan_for_gates(band.plan, budget, band.planned, band.heaviest)
        else:
            gates, slack = foresight.plan(budget)
        return Decisions(k, budget, gates, gates.decision.plan, slack, self.budgets.headroom(k), band.balanced)

    def at_gate(
        self, f: Decisions, layer: int, pairs: float, agree: Callable[[bool], bool] | None = None,
        lockstep: Callable[[bool], bool] | None = None,
    ) -> GateDecision:
        """Deferred planning: `pairs` local routed pairs reached `layer`'s experts, which have not
        run yet; an escalation recomputes them (`f.plan` then says so). `agree`: under expert
        parallelism, whether any rank of the group asks for the layer's collective escalation,
        given this rank's ask (called at every gate that has one, so every rank calls it in the
        same order); the rank joins when another asked. `lockstep`: the same for any escalation,
        at every gate, where the ranks recompute in lockstep (`parallel.lockstep`). None: this
        rank's ask stands alone (the simulator's rank, the busiest of its group)."""
        f.routed[layer] = pairs
        decision = f.gates.at_gate(layer, pairs, f.slack, f.headroom)
        if agree is not None and f.gates.costs[layer].collective is not None:
            if agree(decision.action == "collective") and decision.action != "collective":
                decision = f.gates.join(layer, pairs, f.slack, f.headroom)
        escalates = decision.action in ("escalate", "collective")
        if lockstep is not None and lockstep(escalates) and not escalates:
            decision = f.gates.join(layer, pairs, f.slack, f.headroom, "escalate")
        f.slack, f.headroom = decision.slack, decision.headroom
        if decision.action == "defer":
            f.deferred.append(Deferral(layer, pairs, decision.overrun))
        elif decision.action in ("escalate", "collective"):
            together = decision.action == "collective"
            f.plan = escalated(f.plan, layer, COLLECTIVE_OPS if together else EXPERT_OPS)
            f.escalations.append(Escalation(layer, pairs, decision.overrun, decision.slack, together))
        return decision

    def end(self, f: Decisions, actual: int) -> None:
        """Forward `f` kept `actual` bytes (its room included): its budget becomes that."""
        self.budgets.record(f.k, actual)


def static_plan(
    cm: CostModel, budget: float, tokens: int, seq_len: int | None, routed: float, strategies: Sequence[str] | None,
    options: MitigationOptions = MitigationOptions(),
) -> Plan:
    """A static policy's one plan for every micro-batch (§II-B's static workflow): Algorithm 2 of
    `strategies` at `budget` for `routed` local pairs per MoE layer; where nothing they make fits,
    full recompute as one rank may choose it alone, what a static tuner falls back to. Where
    `strategies` is None, full recompute with the all-to-alls (the same plan on every rank)."""
    if strategies is None:
        return Plan(cm.full_recompute(collective=True))
    try:
        return plan_micro_batch(cm, budget, tokens, [routed] * len(cm.moe_layers), seq_len, strategies, options).plan
    except InfeasibleBudget:
        return Plan(cm.full_recompute())
