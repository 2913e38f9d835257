"""Per-operator mitigation of one micro-batch under its budget: Algorithm 2 of paper §V-A.

Start with nothing mitigated; while the micro-batch would keep more than its budget, apply the
single (op, strategy) candidate with the largest memory reduction on the current plan (a
reduction is re-evaluated after every choice: recomputing an op makes offloading what it made
pointless). A candidate that would conflict with what is already applied (§V-A, cases 1 and 2) is
marked unavailable rather than undoing the earlier, larger reduction. Recompute candidates are
recompute units (`CostModel.recompute_unit`). Pure arithmetic over a `CostModel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..costmodel.conflicts import conflicts
from ..costmodel.graph import OpId
from ..costmodel.mitigation import MITIGATIONS, MitigationOptions
from ..costmodel.model import CostModel, Routed
from ..costmodel.plan import Plan


class InfeasibleBudget(RuntimeError):
    """No mitigation the plan may use brings the micro-batch under its budget."""


@dataclass(frozen=True)
class Decision:
    plan: Plan
    activation_bytes: float  # predicted device bytes kept by the micro-batch under `plan`
    forward_extra_s: float
    backward_extra_s: float
    steps: int  # candidates applied


def plan_micro_batch(
    cm: CostModel,
    budget: float,
    tokens: int,
    routed: Routed = None,
    seq_len: int | None = None,
    strategies: Sequence[str] = MITIGATIONS,
    options: MitigationOptions = MitigationOptions(),
) -> Decision:
    """The plan Algorithm 2 chooses for a micro-batch of `tokens` that may keep `budget` bytes."""
    unknown = set(strategies) - set(MITIGATIONS)
    if unknown:
        raise ValueError(f"strategies: unknown {sorted(unknown)}; expected some of {MITIGATIONS}")
    candidates: list[tuple[tuple[OpId, ...], str]] = []
    for op in cm.ops():
        for strategy in strategies:
            ops = tuple(cm.recompute_unit(op)) if strategy == "recompute" else (op,)
            if ops and (ops, strategy) not in candidates:
                candidates.append((ops, strategy))

    plan: dict[OpId, str] = {}
    footprint = cm.footprint(tokens, routed, seq_len, plan, options)
    steps = 0
    while footprint.device_bytes > budget:
        best = None
        for ops, strategy in candidates:
            if all(plan.get(op) == strategy for op in ops):
                continue
            trial = {**plan, **dict.fromkeys(ops, strategy)}
            cost = cm.footprint(tokens, routed, seq_len, trial, options)
            reduction = footprint.device_bytes - cost.device_bytes
            added = cost.forward_extra_s + cost.backward_extra_s - footprint.forward_extra_s - footprint.backward_extra_s
            if reduction > 0 and (best is None or (reduction, -added) > best[0]):
                best = ((reduction, -added), ops, strategy, trial, cost)
        if best is None:
            raise InfeasibleBudget(
                f"budget {budget:.0f} bytes is below what any plan of {', '.join(strategies)} keeps: at best "
                f"{footprint.device_bytes:.0f} bytes for {tokens} tokens; raise the budget (capacity, reserve, "
                "in-flight micro-batches) or allow more strategies"
            )
        _, ops, strategy, trial, cost = best
        before = {(c.layer, c.tensor) for c in conflicts(Plan(plan), cm)}
        if any((c.layer, c.tensor) not in before for c in conflicts(Plan(trial), cm)):
            candidates.remove((ops, strategy))  # conflicts with a larger reduction already applied
            continue
        plan, footprint, steps = trial, cost, steps + 1
    return Decision(Plan(plan), footprint.device_bytes, footprint.forward_extra_s, footprint.backward_extra_s, steps)
