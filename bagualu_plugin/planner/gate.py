"""Deferred planning at gate time (paper §V-A): right after a MoE router has run, the local routed
pairs of its layer are known and its experts have not run yet. The micro-batch was planned for
`planned` pairs; the pairs beyond that cost `bytes_per_pair` each under its plan. If they fit the
slack left under the budget, nothing changes. In warmup the later warmup micro-batches can give
bytes up (their budgets shrink after this forward, each keeping M0): that headroom absorbs the
overrun before anything is recomputed. Otherwise the layer's routed experts are recomputed as one
unit, which keeps nothing per routed pair in one process (under expert parallelism it holds the
rows dispatch received, so the caller prices it at the pairs that arrived: `gate_costs`).

Under expert parallelism, where that escalation still leaves the micro-batch over its budget, the
gate asks for the collective escalation: the layer's experts recomputed with their dispatch and
combine (`graph.collective_unit`), which holds nothing per routed pair. Its replay runs the
all-to-alls again, so every rank of the group must do it in the same micro-batch: the ranks agree
at each gate (one small collective; the Provisioner's), and a rank that did not ask joins
(`GatePlan.join`). This floor is the static full recompute's (`CostModel.full_recompute(
collective=True)`, Algorithm 1's M0), whatever the routing.

Escalation bounds a layer's growth but need not remove it: under expert parallelism the held rows
still grow with the pairs, and a plan that already mitigates the experts saves little more. So
`plan_for_gates` plans the normal band at a budget that leaves every MoE layer's gate the bytes it
may need once escalated at the heaviest routing the recipe allows (`spikes.spike_max_imbalance`),
and a gate keeps the later layers' share untouched: a micro-batch then stays within its budget up
to that routing, in steady phase too, where no later warmup micro-batch can give bytes up.
Pure arithmetic: numbers in, a decision out; the Provisioner and the simulator (`sim`) both call it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ..costmodel.graph import EXPERT_OPS, BlockGraph
from ..costmodel.linear import Load
from ..costmodel.mitigation import MitigationOptions, footprint
from ..costmodel.model import CostModel
from ..costmodel.plan import Block, Plan
from ..hardware import HardwareSpec
from .greedy import Decision


@dataclass(frozen=True)
class GateDecision:
    action: Literal["fits", "defer", "escalate", "collective"]
    overrun: float  # bytes the arrived pairs need beyond the slack; 0 when they fit
    slack: float  # bytes the micro-batch may still add under its budget, after the decision
    headroom: float  # bytes later warmup micro-batches can still give up, after the decision


def at_gate(
    pairs: float, planned: float, bytes_per_pair: float, escalation_bytes: float, slack: float, headroom: float, reserve: float = 0.0,
    collective_bytes: float | None = None,
) -> GateDecision:
    """What to do when `pairs` local routed pairs reach a layer planned for `planned`.
    `escalation_bytes`: what the layer keeps with its experts recomputed and `pairs` arrived,
    minus what its plan keeps at `planned` pairs (negative: it saves); `reserve`: the part of
    the slack the later layers' gates may need (`GatePlan.after`), which this one leaves alone;
    `collective_bytes`: the same for the collective escalation (None: the layer has none), asked
    for only where the experts' escalation leaves the slack negative."""
    extra = (pairs - planned) * bytes_per_pair
    usable = slack - reserve
    if extra <= usable:  # fewer pairs than planned give nothing back: the plan's estimate stands
        return GateDecision("fits", 0.0, slack - max(extra, 0.0), headroom)
    overrun = extra - usable
    if overrun <= headroom:
        return GateDecision("defer", overrun, reserve, headroom - overrun)
    if collective_bytes is None or slack - escalation_bytes >= 0:
        return GateDecision("escalate", overrun, slack - escalation_bytes, headroom)
    return GateDecision("collective", overrun, slack - collective_bytes, headroom)


class LayerCost(NamedTuple):
    """What the gate of one MoE layer weighs, under a micro-batch's plan at its planned pairs."""

    per_pair: float  # device bytes each local routed pair beyond the planned ones adds
    escalation: float  # bytes recomputing the layer's experts changes, from the plan at planned pairs
    escalated_per_pair: float  # what each local pair adds once they recompute (under EP: the held rows)
    collective: float | None = None  # the same for the collective escalation (None: no expert parallelism)
    collective_per_pair: float = 0.0

    def escalation_bytes(self, pairs: float, planned: float) -> float:
        """`at_gate`'s `escalation_bytes` when `pairs` arrive at a layer planned for `planned`."""
        return self.escalation + (pairs - planned) * self.escalated_per_pair

    def collective_bytes(self, pairs: float, planned: float) -> float | None:
        """`at_gate`'s `collective_bytes` when `pairs` arrive at a layer planned for `planned`."""
        return None if self.collective is None else self.collective + (pairs - planned) * self.collective_per_pair


def escalated(plan: Plan, layer: int, ops: tuple[str, ...] = EXPERT_OPS) -> Plan:
    """`plan` with `layer`'s `ops` recomputed as one unit: the gate's escalation (the routed
    experts), or its collective one (`graph.collective_unit`)."""
    return plan.with_block(layer, dict.fromkeys(ops, "recompute"))


def escalated_block(block: Block, ops: tuple[str, ...] = EXPERT_OPS) -> Block:
    """One layer's block of a plan (`Plan.block`) with the escalation's `ops` recomputed: what
    `escalated` makes of that layer, without making the whole plan."""
    return tuple(sorted({**dict(block), **dict.fromkeys(ops, "recompute")}.items()))


def per_layer(pairs: float | Mapping[int, float], layers: list[int]) -> dict[int, float]:
    """Local routed pairs per MoE layer: `pairs` for each of `layers`, or its own entry for each."""
    if isinstance(pairs, Mapping):
        missing = [layer for layer in layers if layer not in pairs]
        if missing:
            raise ValueError(f"planned pairs: none for MoE layers {missing}; got layers {sorted(pairs)}")
        return {layer: float(pairs[layer]) for layer in layers}
    return dict.fromkeys(layers, float(pairs))


STEP = 1024  # local routed pairs of the finite differences: the bytes are linear in them


def layer_cost(
    block: BlockGraph, plan: Mapping[str, str], load: Load, more: Load, hardware: HardwareSpec, options: MitigationOptions,
) -> LayerCost:
    """What the gate of one MoE block weighs under its ops' strategies `plan`, at `load` (its
    planned local pairs) and `more` (the same with `STEP` pairs more): the bytes of each extra
    pair, what recomputing its routed experts changes, and the bytes per pair then (none in one
    process; under expert parallelism the region holds the dispatched rows), and the same for the
    collective escalation. Finite differences of the cost model's (linear) saved bytes; on
    numbers, or on forms of the shape (`costmodel.symbolic`)."""

    def kept(ops: Mapping[str, str], at: Load) -> float:
        return footprint(block, ops, at, hardware, options).device_bytes

    up = {**plan, **dict.fromkeys(EXPERT_OPS, "recompute")}
    base, recomputed = kept(plan, load), kept(up, load)
    collective: tuple = (None, 0.0)
    if block.collective:
        both = {**plan, **dict.fromkeys(block.collective, "recompute")}
        floor = kept(both, load)
        collective = (floor - base, (kept(both, more) - floor) / STEP)
    return LayerCost((kept(plan, more) - base) / STEP, recomputed - base, (kept(up, more) - recomputed) / STEP, *collective)


def gate_costs(
    cm: CostModel, plan: Plan, tokens: int, seq_len: int | None, planned: float | Mapping[int, float],
    options: MitigationOptions = MitigationOptions(),
) -> dict[int, LayerCost]:
    """`layer_cost` of each MoE layer of `cm` under `plan` at `planned` local pairs (one number
    for every layer, or one per layer: what the plan was made for, `per_layer`), computed once
    for the layers alike (one block, one plan for it, one number of pairs)."""
    planned, alike = per_layer(planned, cm.moe_layers), {}
    costs = {}
    for layer, at in planned.items():
        block, ops = cm.blocks[layer], plan.block(layer)
        key = (id(block), ops, at)
        if key not in alike:
            load, more = (Load.of(tokens, pairs, seq_len, cm.pairs_per_token) for pairs in (at, at + STEP))
            alike[key] = layer_cost(block, dict(ops), load, more, cm.hardware, options)
        costs[layer] = alike[key]
    return costs


@dataclass(frozen=True)
class GatePlan:
    """A micro-batch's plan for the normal band and what its gates weigh: per MoE layer its
    `LayerCost`, `after[layer]`, the bytes the later layers' gates may need (`at_gate`'s
    `reserve`), and `need`, what all its gates may need once escalated at the heaviest routing.
    It depends on the plan alone, never on the budget, so a caller keeps one per plan."""

    decision: Decision
    costs: Mapping[int, LayerCost]
    after: Mapping[int, float]
    planned: Mapping[int, float]  # local routed pairs of each MoE layer the plan was made for
    need: float
    floor: float = 0.0  # what every gate's strongest escalation frees at planned pairs, together

    @classmethod
    def of(
        cls, decision: Decision, costs: Mapping[int, LayerCost], planned: float | Mapping[int, float],
        heaviest: float | Mapping[int, float],
    ) -> GatePlan:
        """`decision`'s gates, each leaving room for its escalation at `heaviest` pairs:
        max(0, `LayerCost.escalation_bytes`). `planned`, `heaviest`: one number for every layer,
        or one per layer (`per_layer`); a gate credits pairs below its own layer's `planned`."""
        layers = list(costs)
        planned, heaviest = per_layer(planned, layers), per_layer(heaviest, layers)
        need = {layer: max(0.0, c.escalation_bytes(heaviest[layer], planned[layer])) for layer, c in costs.items()}
        after, later = {}, 0.0
        for layer in sorted(need, reverse=True):
            after[layer] = later
            later += need[layer]
        floor = -sum(min(0.0, c.escalation if c.collective is None else c.collective) for c in costs.values())
        return cls(decision, costs, after, planned, sum(need.values()), floor)

    def at_gate(self, layer: int, pairs: float, slack: float, headroom: float) -> GateDecision:
        """`at_gate` for `layer` when `pairs` local routed pairs arrive, with the micro-batch's
        current slack and headroom."""
        c, planned = self.costs[layer], self.planned[layer]
        return at_gate(
            pairs, planned, c.per_pair, c.escalation_bytes(pairs, planned), slack, headroom, self.after[layer],
            c.collective_bytes(pairs, planned),
        )

    def join(self, layer: int, pairs: float, slack: float, headroom: float, action: str = "collective") -> GateDecision:
        """`action` ("collective", or "escalate": the experts alone) for `layer` on a rank that did
        not ask for it (another rank of the group did), from the slack and headroom it had before
        its own decision."""
        c, planned = self.costs[layer], self.planned[layer]
        cost = c.collective_bytes(pairs, planned) if action == "collective" else c.escalation_bytes(pairs, planned)
        return GateDecision(action, 0.0, slack - cost, headroom)


def plan_for_gates(
    plan: Callable[[float], tuple[GatePlan, bool]], budget: float, planned: float, heaviest: float
) -> tuple[GatePlan, float]:
    """Algorithm 2 for the normal band (`plan(budget)`: its plan at `planned` local pairs per MoE
    layer, with its gates (`GatePlan`), and whether it fits), at a budget that leaves each
    layer's gate what it may need once escalated at `heaviest` pairs (`GatePlan.need`). When the
    first plan leaves less, Algorithm 2 runs again at the budget less those bytes; as the plan
    mitigates more the escalations save less, so this repeats until a plan leaves its own gates'
    bytes (each round's needs exceed the last's, and plans are finitely many). If the budget
    cannot hold that much, the last plan is the best there is: its gates escalate and the overrun
    is the caller's to report. If no plan fits the budget even at `planned` pairs, the plan is the
    most Algorithm 2 can save (`InfeasibleBudget.best`, its slack negative): lighter routing than
    planned may still fit. Returns the plan's gates and its slack: the budget less what the plan
    keeps and its room (`Footprint.room_bytes`)."""
    chosen, _ = plan(budget)
    while True:
        decision = chosen.decision
        slack = budget - decision.activation_bytes - decision.room_bytes
        if slack >= chosen.need or heaviest <= planned:
            return chosen, slack
        tighter, fits = plan(budget - chosen.need)
        if not fits or tighter.decision.plan == decision.plan:
            return chosen, slack
        chosen = tighter
