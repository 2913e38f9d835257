"""Pipeline-aware memory budget of each forward micro-batch: Algorithm 1 of paper §V-A.

In warmup no backward frees memory, so each new micro-batch gets an even share of what is left
while every micro-batch not yet launched keeps its minimum M0 (the activation memory of full
recompute). In the steady phase each forward follows the backward of the micro-batch `warmup`
places earlier, and gets all the memory that backward freed. After every forward the budget is
replaced by what the micro-batch really kept, so an estimate that was off does not cascade.

With nanotron's 1F1B, rank r of P runs P - r - 1 forwards before the first steady forward, which
also runs before any backward: the micro-batches that stack are `warmup = min(P - r, m)`. With
interleaved 1F1B (§VI-A) every forward is one model chunk of a micro-batch, B_w counts chunk
forwards (`costmodel.pipeline.warmup_depth`), M0 is the largest chunk's, and the backward before a
steady forward frees the chunk `costmodel.pipeline.release_order` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BudgetState:
    """Algorithm 1's state: `budget(i)` before forward i, `record(i, actual)` after it (in place:
    a simulation records hundreds of forwards per iteration), or `after_forward(i, actual)` for a
    new state."""

    capacity: int  # M_max: device bytes activations and static memory may use together
    min_budget: int  # M0
    warmup: int  # B_w
    used: int  # M_used: static bytes plus the budgets (actuals) of live micro-batches
    budgets: list[int] = field(default_factory=list)  # actual bytes of micro-batches 0..i-1
    released: tuple[int, ...] | None = None  # forward warmup + j frees released[j]; None: j (plain 1F1B)

    @classmethod
    def start(
        cls, capacity: int, static_bytes: int, min_budget: int, warmup: int, released: tuple[int, ...] | None = None
    ) -> BudgetState:
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 micro-batch, got {warmup}")
        if min_budget < 0 or static_bytes < 0:
            raise ValueError(f"min_budget and static_bytes must be >= 0, got {min_budget} and {static_bytes}")
        free = capacity - static_bytes - warmup * min_budget
        if free < 0:
            raise ValueError(
                f"capacity {capacity} bytes cannot hold static memory {static_bytes} plus {warmup} in-flight "
                f"micro-batches at the minimum M0 = {min_budget} bytes ({-free} bytes short): "
                "lower the micro-batch size or sequence length, raise pipeline parallelism, or shard more state"
            )
        return cls(capacity, min_budget, warmup, static_bytes, released=released)

    def budget(self, i: int) -> int:
        """Bytes micro-batch i's forward may keep (line 5 in warmup, lines 11-12 in steady)."""
        self._check(i)
        if i < self.warmup:
            r = self.warmup - i
            return (self.capacity - self.used - r * self.min_budget) // r + self.min_budget
        return self.capacity - (self.used - self.budgets[self._freed(i)])

    def headroom(self, i: int) -> int:
        """Bytes micro-batch i may keep beyond its budget: in warmup, what the later warmup
        micro-batches can give up while each keeps M0 (their budgets shrink after this forward);
        in steady none, the budget already being all the free memory."""
        if i >= self.warmup:
            return 0
        later = self.warmup - i - 1
        return self.capacity - self.used - later * self.min_budget - self.budget(i)

    def record(self, i: int, actual: int) -> None:
        """Replace micro-batch i's budget by what it kept (lines 7-8, 14-15)."""
        self._check(i)
        self.used += actual
        if i >= self.warmup:  # the backward before this forward released an earlier one
            self.used -= self.budgets[self._freed(i)]
        self.budgets.append(actual)

    def after_forward(self, i: int, actual: int) -> BudgetState:
        """A new state: this one with `record(i, actual)`."""
        state = self.copy()
        state.record(i, actual)
        return state

    def copy(self) -> BudgetState:
        return BudgetState(self.capacity, self.min_budget, self.warmup, self.used, list(self.budgets), self.released)

    def _freed(self, i: int) -> int:
        """The micro-batch whose memory the backward before steady forward i released."""
        j = i - self.warmup
        return j if self.released is None else self.released[j]

    def _check(self, i: int) -> None:
        if i != len(self.budgets):
            raise ValueError(f"micro-batch {i} out of order: {len(self.budgets)} forwards have run")
