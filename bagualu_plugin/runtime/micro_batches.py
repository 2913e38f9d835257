"""What the runtime keeps of each micro-batch between its forward and the end of its backward, in
one place (as nanotron keeps one batch's buffers in its `PipelineTrainBatchState`): which
micro-batch the saves are charged to now, and each one's recompute regions, host-copy chain,
foreseen routing and finished forward's event. The Ledger, the plan's hooks, the regions, the
Provisioner and the dual-batch executor are handed this one object; none keeps its own copy."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class MicroBatchState:
    """One micro-batch's state, from its first use until its backward has run (`release`)."""

    index: int | None
    regions: dict[int, list[weakref.ref]] = field(default_factory=dict)  # its live recompute regions by layer
    offloads: object = None  # its latest op's host copies, chained to the op's before (`runtime.hooks`)
    foreseen: tuple | None = None  # its next forward and the plan for its routing known ahead (`Provisioner.foresee`)
    event: object = None  # its forward's event while its backward is awaited (`Provisioner.end_forward`)


class MicroBatches:
    """Every micro-batch's state, and `running`: the micro-batch the saves are charged to now (the
    Ledger attributes each new record to it; None outside any). The Provisioner sets it as a
    forward begins; `charging` runs another one's backward work inside a forward."""

    def __init__(self) -> None:
        self.running: int | None = None
        self._states: dict[int | None, MicroBatchState] = {}

    def of(self, index: int | None) -> MicroBatchState:
        """Micro-batch `index`'s state (made on first use)."""
        state = self._states.get(index)
        if state is None:
            state = self._states[index] = MicroBatchState(index)
        return state

    def get(self, index: int | None) -> MicroBatchState | None:
        """Micro-batch `index`'s state, if it has one."""
        return self._states.get(index)

    def __iter__(self) -> Iterator[MicroBatchState]:
        """Every micro-batch's state (a copy of the list: the caller may release them)."""
        return iter(list(self._states.values()))

    def awaiting(self) -> list[int]:
        """The micro-batches whose forward has ended and whose backward has not, in order."""
        return sorted(index for index, state in self._states.items() if state.event is not None)

    def release(self, index: int | None) -> None:
        """Micro-batch `index`'s backward has run: its state goes now, not at its next forward, so
        that what the runtime holds between iterations does not depend on the plans that ran."""
        self._states.pop(index, None)

    @contextmanager
    def charging(self, index: int | None) -> Iterator[None]:
        """Inside: saves are charged to micro-batch `index` (its backward or recovery run inside
        another's forward); after it, to the one before."""
        before, self.running = self.running, index
        try:
            yield
        finally:
            self.running = before
