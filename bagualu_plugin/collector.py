"""The garbage collector around long loops. With torch and transformers loaded the heap holds
hundreds of thousands of tracked objects, and a full collection walks them all (0.2-0.3 s on a
CPU core) at an iteration nobody chose: inside a timed decision, or on one rank while the others
wait at its next collective. What exists once a loop is set up lives to its end, so it is frozen
out of the collector (`gc.freeze`), as long training loops do; collections then walk only what
the loop itself allocates.

Across ranks a pause still stalls every rank at the next collective, so a training loop also
turns automatic collection off and collects at its iteration boundaries (`ManualCollector`), on
every rank at the same iteration, as Megatron-LM's manual GC does: the pauses line up instead of
adding up.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter


@contextmanager
def frozen() -> Iterator[None]:
    """Collect once, then keep every object alive now out of the collector until the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class ManualCollector:
    """The collector of a training loop: on entering, what exists is collected once and frozen
    and automatic collection is off; `step()` at each iteration boundary collects every
    `interval`-th time (every rank of a job calls it at the same iterations, so their pauses
    coincide); on leaving, all is as before. `enabled=False` leaves Python's collector alone
    (the switch the launchers expose). `collections` and `seconds`: what `step` did."""

    def __init__(self, enabled: bool = True, interval: int = 1):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be an int >= 1 (iterations between collections), got {interval!r}")
        self.enabled, self.interval = bool(enabled), interval
        self.collections, self.seconds, self._steps = 0, 0.0, 0
        self._was_enabled: bool | None = None

    def __enter__(self) -> ManualCollector:
        if self.enabled:
            if self._was_enabled is not None:
                raise RuntimeError("ManualCollector is entered already")
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
        return self

    def step(self) -> None:
        """An iteration ended (on every rank): collect if it is the `interval`-th since the last."""
        if not self.enabled:
            return
        self._steps += 1
        if self._steps % self.interval == 0:
            start = perf_counter()
            gc.collect()
            self.seconds += perf_counter() - start
            self.collections += 1

    def __exit__(self, *exc) -> None:
        if self.enabled and self._was_enabled is not None:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None
