"""Per-operator mitigation of one micro-batch under its budget: Algorithm 2 of paper §V-A.

Start with nothing mitigated; while the micro-batch would need more than its budget (what it
keeps, and room for its backward to bring its offloaded copies back: `Footprint.needed_bytes`), apply the
single (op, strategy) candidate with the largest memory reduction on the current plan (a
reduction is re-evaluated after every choice: recomputing an op makes offloading what it made
pointless). A candidate that would conflict with what is already applied (§V-A, cases 1 and 2)
is marked unavailable rather than undoing the earlier, larger reduction. Recompute candidates
are recompute units (`CostModel.recompute_unit`). The greedy's choices need not reach what
full recompute keeps (M0, which Algorithm 1 guarantees: under expert parallelism a mix of
offloads and casts of the largest tensors can stop above it), so where recompute is allowed
and the greedy ends over the budget, full recompute is the plan if it fits. Pure arithmetic
over a `CostModel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..costmodel.conflicts import conflicts
from ..costmodel.graph import OpId
from ..costmodel.mitigation import MITIGATIONS, Footprint, MitigationOptions, footprint
from ..costmodel.model import CostModel, Routed, holds_arguments
from ..costmodel.plan import Plan


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
    reload_bytes: float  # room its backward needs to bring offloaded copies back (Footprint)
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

    # Only the candidate's block changes, so each trial re-evaluates one block.
    loads = cm.loads(tokens, routed, seq_len)
    plans: dict[int, dict[str, str]] = {i: {} for i in cm.blocks}
    parts = {i: footprint(b, {}, loads[i], cm.hardware, options) for i, b in cm.blocks.items()}
    holding: set[int] = set()

    def total(parts: dict[int, Footprint], holding: set[int]) -> Footprint:
        return sum(parts.values(), Footprint()) + Footprint(device_bytes=cm.argument_bytes(loads, holding))

    plan: dict[OpId, str] = {}
    current = total(parts, holding)
    steps = 0
    while current.needed_bytes > budget:
        best = None
        for ops, strategy in candidates:
            if all(plan.get(op) == strategy for op in ops):
                continue
            if strategy != "recompute" and any(plan.get(op) == "recompute" for op in ops):
                continue  # an op in a recompute unit keeps nothing to offload or quantise
            i = ops[0].layer
            block_plan = {**plans[i], **{op.name: strategy for op in ops}}
            trial_parts = {**parts, i: footprint(cm.blocks[i], block_plan, loads[i], cm.hardware, options)}
            trial_holding = holding | {i} if holds_arguments(cm.blocks[i], block_plan) else holding - {i}
            cost = total(trial_parts, trial_holding)
            reduction = current.needed_bytes - cost.needed_bytes
            freed = current.device_bytes - cost.device_bytes
            added = cost.forward_extra_s + cost.backward_extra_s - current.forward_extra_s - current.backward_extra_s
            # The first offloads may free only what their copies need back in backward (the two
            # largest ops' copies come back at once); they still make room for the next ones.
            useful = reduction > 0 or (reduction == 0 and freed > 0)
            if useful and (best is None or (reduction, freed, -added) > best[0]):
                best = ((reduction, freed, -added), ops, strategy, block_plan, trial_parts, trial_holding, cost)
        if best is None:
            break
        _, ops, strategy, block_plan, trial_parts, trial_holding, cost = best
        trial = {**plan, **dict.fromkeys(ops, strategy)}
        if conflicts(Plan(trial), cm):  # the applied plan has none: only conflict-free trials apply
            candidates.remove((ops, strategy))  # conflicts with a larger reduction already applied
            continue
        plan, parts, holding, current, steps = trial, trial_parts, trial_holding, cost, steps + 1
        plans[ops[0].layer] = block_plan
    if current.needed_bytes > budget and "recompute" in strategies:
        whole = cm.full_recompute()
        cost = cm.footprint(tokens, routed, seq_len, whole, options)
        if cost.needed_bytes <= budget:
            return _decision(whole, cost, steps)
    if current.needed_bytes > budget:
        raise InfeasibleBudget(
            f"budget {budget:.0f} bytes is below what any plan of {', '.join(strategies)} keeps: at best "
            f"{current.needed_bytes:.0f} bytes for {tokens} tokens; raise the budget (capacity, reserve, "
            "in-flight micro-batches) or allow more strategies",
            _decision(plan, current, steps),
        )
    return _decision(plan, current, steps)


def _decision(plan: dict[OpId, str], cost: Footprint, steps: int) -> Decision:
    return Decision(Plan(plan), cost.device_bytes, cost.reload_bytes, cost.forward_extra_s, cost.backward_extra_s, steps)


class CachedPlanner:
    """Algorithm 2 behind a cache (paper §V-B's observation holds for plans too: budgets repeat
    with the pipeline phase and routing is stable for most micro-batches). Budgets are rounded
    down to `budget_quantum` bytes and local routed pairs to `routed_quantum` pairs, so a cached
    plan always fits the budget it is served for and plans a slightly heavier routing."""

    def __init__(
        self,
        cm: CostModel,
        budget_quantum: int = 64 << 20,
        routed_quantum: int = 256,
        strategies: Sequence[str] = MITIGATIONS,
        options: MitigationOptions = MitigationOptions(),
    ):
        if budget_quantum <= 0 or routed_quantum <= 0:
            raise ValueError(f"quanta must be > 0, got budget {budget_quantum}, routed {routed_quantum}")
        self.cm, self.strategies, self.options = cm, tuple(strategies), options
        self.budget_quantum, self.routed_quantum = budget_quantum, routed_quantum
        self._cache: dict[tuple, Decision] = {}
        self.hits = self.misses = 0

    def plan(self, budget: float, tokens: int, routed: Sequence[float] | None = None, seq_len: int | None = None) -> Decision:
        q = self.routed_quantum
        pairs = None if routed is None else tuple(-(-int(r) // q) * q for r in routed)  # round up
        key = (int(budget // self.budget_quantum), tokens, seq_len, pairs)
        decision = self._cache.get(key)
        if decision is None:
            self.misses += 1
            floor = key[0] * self.budget_quantum
            try:
                decision = plan_micro_batch(self.cm, floor, tokens, pairs, seq_len, self.strategies, self.options)
            except InfeasibleBudget as exc:
                decision = exc
            self._cache[key] = decision
        else:
            self.hits += 1
        if isinstance(decision, InfeasibleBudget):
            raise decision
        return decision
