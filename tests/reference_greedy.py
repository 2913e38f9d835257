"""Algorithm 2 (paper §V-A) as this project computed it until the planner served every shape from
a few paths (2026-12): the greedy over every candidate of every layer, each trial priced by
summing the whole plan's blocks again. Kept here, not in the package, as the no-worse rule's
reference (tests/test_planner_path.py): where that sum rounded two equal candidates apart, it
chose by the noise, where the package now chooses the first in program order; the plans then
differ, their bytes and times do not."""

from __future__ import annotations

from bagualu_plugin.costmodel import Forward
from bagualu_plugin.costmodel.conflicts import conflicts
from bagualu_plugin.costmodel.mitigation import Footprint, footprint
from bagualu_plugin.costmodel.model import holds_arguments
from bagualu_plugin.costmodel.plan import Plan


def plan_micro_batch(cm, budget, tokens, routed, seq_len, strategies, options) -> tuple[str, Plan, Footprint]:
    """("plan", the plan, its footprint) at `budget`, or ("infeasible", the most it saves, its footprint)."""
    candidates = []
    for op in cm.ops():
        for strategy in strategies:
            ops = tuple(cm.recompute_unit(op)) if strategy == "recompute" else (op,)
            if ops and (ops, strategy) not in candidates:
                candidates.append((ops, strategy))
    loads = cm.loads(Forward(tokens, seq_len, routed))

    def block_cost(i: int, block_plan: dict[str, str]) -> tuple[Footprint, bool]:
        block = cm.blocks[i]
        return footprint(block, block_plan, loads[i], cm.hardware, options), holds_arguments(block, block_plan)

    def total(parts: dict[int, Footprint], holding: set[int]) -> Footprint:
        return sum(parts.values(), Footprint()) + Footprint(device_bytes=cm.argument_bytes(loads, holding))

    plans = {i: {} for i in cm.blocks}
    parts, holding, plan = {i: block_cost(i, {})[0] for i in cm.blocks}, set(), {}
    current = total(parts, holding)
    while current.needed_bytes > budget:
        best = None
        for ops, strategy in candidates:
            if all(plan.get(op) == strategy for op in ops):
                continue
            if strategy != "recompute" and any(plan.get(op) == "recompute" for op in ops):
                continue
            i = ops[0].layer
            block_plan = {**plans[i], **{op.name: strategy for op in ops}}
            trial_cost, holds = block_cost(i, block_plan)
            trial_parts = {**parts, i: trial_cost}
            trial_holding = holding | {i} if holds else holding - {i}
            cost = total(trial_parts, trial_holding)
            reduction = current.needed_bytes - cost.needed_bytes
            freed = current.device_bytes - cost.device_bytes
            added = cost.forward_extra_s + cost.backward_extra_s - current.forward_extra_s - current.backward_extra_s
            useful = reduction > 0 or (reduction == 0 and freed > 0)
            if useful and (best is None or (reduction, freed, -added) > best[0]):
                best = ((reduction, freed, -added), ops, strategy, block_plan, trial_parts, trial_holding, cost)
        if best is None:
            break
        _, ops, strategy, block_plan, trial_parts, trial_holding, cost = best
        trial = {**plan, **dict.fromkeys(ops, strategy)}
        if conflicts(Plan(trial), cm):
            candidates.remove((ops, strategy))
            continue
        plan, parts, holding, current = trial, trial_parts, trial_holding, cost
        plans[ops[0].layer] = block_plan
    if current.needed_bytes <= budget:
        return "plan", Plan(plan), current
    whole = Plan(cm.full_recompute()) if "recompute" in strategies else None
    if whole is not None:
        cost = cm.footprint(Forward(tokens, seq_len, routed), whole, options)
        if cost.needed_bytes <= budget:
            return "plan", whole, cost
        if cost.needed_bytes < current.needed_bytes:
            return "infeasible", whole, cost
    return "infeasible", Plan(plan), current
