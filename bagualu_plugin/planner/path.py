"""Algorithm 2 of paper §V-A as one budget-independent path per micro-batch shape, extended lazily.

Algorithm 2's next candidate depends only on the plan so far, and the need
(`Footprint.needed_bytes`) never grows along its plans: the budget only decides where it stops.
`PathPlanner` keeps that path (`greedy_path`) per tokens, sequence length and routing bucket,
extends it only as far as the budgets asked so far need, and answers a budget with the first plan
on it that fits, or with the greedy's end (full recompute where allowed and it fits, else a new
`InfeasibleBudget`): exactly what `plan_micro_batch` returns from scratch at the same rounded
budget and routing.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from ..costmodel.graph import OpId
from ..costmodel.mitigation import MITIGATIONS, Footprint, MitigationOptions
from ..costmodel.model import CostModel
from .greedy import Decision, _decision, _full_recompute, _infeasible, greedy_path

_Key = tuple[int, int | None, tuple[int, ...] | None]


class _Path:
    """The plans of one path computed so far, their negated needs (ascending: `bisect` finds the
    first plan that fits), the rest of the path to come (None once it ended) with its footprint
    memo, and, once asked for, the full-recompute fallback past its end."""

    __slots__ = ("decisions", "negated", "rest", "memo", "fallback", "fallback_known")

    def __init__(self, rest: Iterator[tuple[dict[OpId, str], Footprint, int]], memo: dict):
        self.decisions: list[Decision] = []
        self.negated: list[float] = []
        self.rest: Iterator[tuple[dict[OpId, str], Footprint, int]] | None = rest
        self.memo: dict | None = memo
        self.fallback: tuple[Footprint, Decision] | None = None
        self.fallback_known = False


class PathPlanner:
    """Algorithm 2 (§V-A) for repeated budgets and routings: one lazily extended path per
    (tokens, seq_len, routing bucket), each budget answered from it. Budgets are rounded down to
    `budget_quantum` bytes and local routed pairs up to `routed_quantum` pairs, so a plan always
    fits the budget it is served for and plans a slightly heavier routing.

    Counters: `answers` (calls to `plan`), `paths` (paths started), `steps_computed` (candidates
    applied on them), `footprints` (block footprints evaluated: each (block, block plan) once per
    path, and one per block for a full-recompute fallback)."""

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
        self._paths: dict[_Key, _Path] = {}
        self.answers = self.steps_computed = self.footprints = 0

    @property
    def paths(self) -> int:
        return len(self._paths)

    def plan(self, budget: float, tokens: int, routed: Sequence[float] | None = None, seq_len: int | None = None) -> Decision:
        """`plan_micro_batch` at the budget rounded down and the routing (pairs per MoE layer)
        rounded up: the first plan on the path that fits, else the greedy's end."""
        return self.answer(self.key(tokens, routed, seq_len), budget)

    def key(self, tokens: int, routed: Sequence[float] | None = None, seq_len: int | None = None) -> _Key:
        """The path a shape and routing (rounded up) are answered from: `answer`'s first argument,
        for a caller that asks it again and again."""
        q = self.routed_quantum
        return tokens, seq_len, None if routed is None else tuple(math.ceil(r / q) * q for r in routed)

    def answer(self, key: _Key, budget: float) -> Decision:
        """`plan` on the path `key` names."""
        floor = int(budget // self.budget_quantum) * self.budget_quantum
        self.answers += 1
        path = self._path(key, floor)
        i = bisect_left(path.negated, -floor)
        if i == len(path.negated):
            i = self._extend(key, path, floor)
        if i < len(path.decisions):
            return path.decisions[i]
        fallback = self._fallback(key, path)
        if fallback is not None and fallback[0].needed_bytes <= floor:
            return fallback[1]
        raise _infeasible(floor, key[0], self.strategies, path.decisions[-1], fallback)  # new each time

    def complete(self, key: _Key) -> list[Decision]:
        """Every plan `answer` can give on the path `key` names, computed now (the whole path
        and its full-recompute fallback), so later budgets are answered without a footprint."""
        path = self._path(key, float("-inf"))
        self._extend(key, path, float("-inf"))
        fallback = self._fallback(key, path)
        return path.decisions + ([fallback[1]] if fallback is not None else [])

    def _path(self, key: _Key, floor: float) -> _Path:
        path = self._paths.get(key)
        if path is None:
            tokens, seq_len, pairs = key
            path = _Path(greedy_path(self.cm, tokens, pairs, seq_len, self.strategies, self.options, memo := {}), memo)
            self._extend(key, path, floor)  # a bad query raises here and leaves no path behind
            self._paths[key] = path
        return path

    def _fallback(self, key: _Key, path: _Path) -> tuple[Footprint, Decision] | None:
        """Full recompute past the path's end, where allowed (computed once)."""
        if not path.fallback_known:
            tokens, seq_len, pairs = key
            path.fallback = _full_recompute(self.cm, tokens, pairs, seq_len, self.strategies, self.options, path.decisions[-1].steps)
            path.fallback_known = True
            self.footprints += len(self.cm.blocks) if path.fallback is not None else 0
        return path.fallback

    def _extend(self, key: _Key, path: _Path, floor: float) -> int:
        """Compute the path's next plans until one needs at most `floor` bytes (its index) or the
        path ends (the number of plans)."""
        while path.rest is not None:
            known = len(path.memo)
            try:
                step = next(path.rest, None)
            except BaseException:
                self._paths.pop(key, None)  # a generator that raised is over: start this path again next time
                raise
            self.footprints += len(path.memo) - known
            if step is None:
                path.rest = path.memo = None  # the memo only serves extensions
                break
            plan, cost, steps = step
            needed = cost.needed_bytes
            if path.negated and -needed < path.negated[-1]:
                raise RuntimeError(f"Algorithm 2's path grew its need at step {steps}: {-path.negated[-1]:.0f} -> {needed:.0f} bytes")
            path.decisions.append(_decision(plan, cost, steps))
            path.negated.append(-needed)
            self.steps_computed += steps > 0
            if needed <= floor:
                return len(path.decisions) - 1
        return len(path.decisions)
