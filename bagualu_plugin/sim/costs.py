"""What one micro-batch costs a pipeline stage under a plan and a routing (paper §IV): forward
and backward seconds (every op at its load, the all-to-alls at the routed pairs of the busiest
expert-parallel rank, plus the plan's mitigation time) and the device bytes it keeps, with the
room its backward needs to reload offloaded copies.

The numbers are `CostModel.micro_batch` and `CostModel.footprint`'s, composed block by block
from `costmodel.mitigation.footprint` as those do, with every block's answer memoised per
(block, its plan, its routing bucket): a simulation asks for the same few thousand of them
millions of times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..costmodel import Footprint, Forward, OpId, footprint
from ..costmodel.model import holds_arguments
from ..costmodel.plan import Plan
from ..stage import Stage


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one stage: its times and what it holds from its forward to its backward."""

    forward_s: float
    backward_s: float
    device_bytes: float  # kept for backward
    room_bytes: float  # room beyond what it keeps: its backward's reloads or a moment's saves (`Footprint.room_bytes`)

    @property
    def held_bytes(self) -> float:
        """What Algorithm 1 charges it (§V-A): what it keeps and its room beyond that."""
        return self.device_bytes + self.room_bytes


class StageCosts:
    """Memoised micro-batch costs of one stage; `under(plan)` gives a plan's."""

    def __init__(self, stage: Stage):
        self.stage, self.cm = stage, stage.cost
        self.balanced = stage.tokens * self.cm.pairs_per_token  # local routed pairs per MoE layer, balanced
        self._plans: dict[tuple, PlanCosts] = {}
        self._blocks: dict[tuple, tuple[float, float, Footprint]] = {}

    def under(self, plan: Plan) -> PlanCosts:
        costs = self._plans.get(plan.key)
        if costs is None:
            costs = self._plans[plan.key] = PlanCosts(self, plan)
        return costs

    def block(self, i: int, plan: tuple[tuple[str, str], ...], imbalance: float | None, load) -> tuple[float, float, Footprint]:
        """Block `i`'s forward and backward op seconds and its footprint under `plan` at `load`
        (`imbalance`: its routing bucket, None for a block without routed experts)."""
        key = (i, plan, imbalance)
        hit = self._blocks.get(key)
        if hit is None:
            block, cm = self.cm.blocks[i], self.cm
            hit = self._blocks[key] = (
                sum(op.forward_s.at(load) for op in block.ops),
                sum(op.backward_s.at(load) for op in block.ops),
                footprint(block, dict(plan), load, cm.hardware, self.stage.options),
            )
        return hit


class PlanCosts:
    """One plan's micro-batch costs on a stage, by the routing of its MoE layers."""

    def __init__(self, costs: StageCosts, plan: Mapping[OpId, str]):
        self.costs, self.plan = costs, plan
        per_block: dict[int, dict[str, str]] = {i: {} for i in costs.cm.blocks}
        for op, strategy in plan.items():
            per_block[op.layer][op.name] = strategy
        self._block_plans = {i: tuple(sorted(p.items())) for i, p in per_block.items()}
        self._holding = {i for i, b in costs.cm.blocks.items() if holds_arguments(b, per_block[i])}
        self._memo: dict[tuple[float, ...], MicroBatch] = {}

    def at(self, imbalance: tuple[float, ...]) -> MicroBatch:
        """The micro-batch whose MoE layers (the stage's, in order) route `imbalance` x balanced."""
        hit = self._memo.get(imbalance)
        if hit is not None:
            return hit
        c = self.costs
        stage = c.stage
        loads = c.cm.loads(Forward(stage.tokens, stage.recipe.batch.seq_len, [c.balanced * x for x in imbalance]))
        of_layer = dict(zip(c.cm.moe_layers, imbalance))
        fwd = bwd = 0.0
        total = Footprint()
        for i, plan in self._block_plans.items():
            f, b, fp = c.block(i, plan, of_layer.get(i), loads[i])
            fwd, bwd, total = fwd + f, bwd + b, total + fp
        total += Footprint(device_bytes=c.cm.argument_bytes(loads, self._holding))
        hit = self._memo[imbalance] = MicroBatch(
            fwd + total.forward_extra_s, bwd + total.backward_extra_s, total.device_bytes, total.room_bytes
        )
        return hit
