"""The garbage collector around long loops. With torch and transformers loaded the heap holds
hundreds of thousands of tracked objects, and a full collection walks them all (0.2-0.3 s on a
CPU core) at an iteration nobody chose: inside a timed decision, or on one rank while the others
wait at its next collective. What exists once a loop is set up lives to its end, so it is frozen
out of the collector (`gc.freeze`), as long training loops do; collections then walk only what
the loop itself allocates.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen() -> Iterator[None]:
    """Collect once, then keep every object alive now out of the collector until the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
