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

The greedy's choices never depend on the budget, only where it stops: `greedy_path` yields its
successive plans, `plan_micro_batch` takes the first that fits, and `PathPlanner` (planner/path.py)
keeps the path to answer every budget from it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
    room_bytes: float  # room beyond what it keeps: its backward's reloads or a moment's saves (`Footprint.room_bytes`)
    forward_extra_s: float
    backward_extra_s: float
    steps: int  # candidates applied


def greedy_path(
    cm: CostModel,
    tokens: int,
    routed: Routed = None,
    seq_len: int | None = None,
    strategies: Sequence[str] = MITIGATIONS,
    options: MitigationOptions = MitigationOptions(),
    memo: dict[tuple[int, frozenset[tuple[str, str]]], tuple[Footprint, bool]] | None = None,
) -> Iterator[tuple[dict[OpId, str], Footprint, int]]:
    """Algorithm 2's successive plans (§V-A) as (plan, footprint, steps applied), lazily: nothing
    mitigated first, then one plan per applied candidate, until no candidate reduces the need. A
    choice depends only on the plan so far, never on the budget, and `needed_bytes` never grows
    along the path: a budget's plan is the first that fits it. `memo` (one per cost model, options
    and loads, i.e. tokens, routing and sequence length) keeps each (block, block plan)'s
    footprint across trials and steps; None evaluates every trial afresh."""
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

    def block_cost(i: int, block_plan: dict[str, str]) -> tuple[Footprint, bool]:
        key = (i, frozenset(block_plan.items()))
        cost = None if memo is None else memo.get(key)
        if cost is None:
            block = cm.blocks[i]
            cost = footprint(block, block_plan, loads[i], cm.hardware, options), holds_arguments(block, block_plan)
            if memo is not None:
                memo[key] = cost
        return cost

    plans: dict[int, dict[str, str]] = {i: {} for i in cm.blocks}
    parts = {i: block_cost(i, {})[0] for i in cm.blocks}
    holding: set[int] = set()

    arguments: dict[frozenset[int], float] = {}  # the layer arguments the holding layers keep

    def total(parts: dict[int, Footprint], holding: set[int]) -> Footprint:
        held = frozenset(holding)
        if held not in arguments:
            arguments[held] = cm.argument_bytes(loads, holding)
        return sum(parts.values(), Footprint()) + Footprint(device_bytes=arguments[held])

    plan: dict[OpId, str] = {}
    current = total(parts, holding)
    steps = 0
    yield plan, current, steps
    while True:
        best = None
        for ops, strategy in candidates:
            if all(plan.get(op) == strategy for op in ops):
                continue
            if strategy != "recompute" and any(plan.get(op) == "recompute" for op in ops):
                continue  # an op in a recompute unit keeps nothing to offload or quantise
            i = ops[0].layer
            block_plan = {**plans[i], **{op.name: strategy for op in ops}}
            trial_cost, holds = block_cost(i, block_plan)
            trial_parts = {**parts, i: trial_cost}
            trial_holding = holding | {i} if holds else holding - {i}
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
            return
        _, ops, strategy, block_plan, trial_parts, trial_holding, cost = best
        trial = {**plan, **dict.fromkeys(ops, strategy)}
        if conflicts(Plan(trial), cm):  # the applied plan has none: only conflict-free trials apply
            candidates.remove((ops, strategy))  # conflicts with a larger reduction already applied
            continue
        plan, parts, holding, current, steps = trial, trial_parts, trial_holding, cost, steps + 1
        plans[ops[0].layer] = block_plan
        yield plan, current, steps


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
    for plan, current, steps in greedy_path(cm, tokens, routed, seq_len, strategies, options):
        if current.needed_bytes <= budget:
            return _decision(plan, current, steps)
    whole = _full_recompute(cm, tokens, routed, seq_len, strategies, options, steps)
    if whole is not None and whole[0].needed_bytes <= budget:
        return whole[1]
    raise _infeasible(budget, tokens, strategies, _decision(plan, current, steps), whole)


def _full_recompute(
    cm: CostModel,
    tokens: int,
    routed: Routed,
    seq_len: int | None,
    strategies: Sequence[str],
    options: MitigationOptions,
    steps: int,
) -> tuple[Footprint, Decision] | None:
    """Where the greedy's path ends above the budget (§V-A): full recompute (M0, which Algorithm 1
    guarantees) with its footprint, when recompute is allowed; None otherwise."""
    if "recompute" not in strategies:
        return None
    whole = cm.full_recompute()
    cost = cm.footprint(tokens, routed, seq_len, whole, options)
    return cost, _decision(whole, cost, steps)


def _infeasible(
    budget: float, tokens: int, strategies: Sequence[str], last: Decision, whole: tuple[Footprint, Decision] | None
) -> InfeasibleBudget:
    """A new `InfeasibleBudget` for `budget` (never re-raise a kept one: each raise chains the
    raiser's frames onto its traceback), its best plan the greedy's end `last` or full recompute
    (`whole`), whichever needs less: the gates' escalations start from it."""
    best = whole[1] if whole is not None and whole[0].needed_bytes < last.activation_bytes + last.room_bytes else last
    return InfeasibleBudget(
        f"budget {budget:.0f} bytes is below what any plan of {', '.join(strategies)} keeps: at best "
        f"{best.activation_bytes + best.room_bytes:.0f} bytes for {tokens} tokens; raise the budget (capacity, reserve, "
        "in-flight micro-batches) or allow more strategies",
        best,
    )


def _decision(plan: dict[OpId, str], cost: Footprint, steps: int) -> Decision:
    return Decision(Plan(plan), cost.device_bytes, cost.room_bytes, cost.forward_extra_s, cost.backward_extra_s, steps)
