"""The spill mover: kept activations moved to host memory when a save would take the Ledger's count
past its ``spill_at``, and back when backward unpacks them; the last resort of a plan made for less
than its forward keeps. Bitwise: a copy out and back.

Separate from the count (ledger.py), which decides when room is needed and counts what moved where:
this moves the storages themselves and remembers where each one's bytes are. Every call comes from
the Ledger, under its lock; the Ledger's entries are read for their ``record.nbytes`` and ``holders``
(weak references to the recorded tensor objects), and their ``spilled`` is this mover's own.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

UNPACKED = "_bagualu_unpacked"  # set on a pack alias backward has unpacked: it is in use, never spilled


class Spill:
    """The Ledger's entries whose storages are emptied, their bytes on the host."""

    def __init__(self) -> None:
        self._spilled: dict[int, Any] = {}  # by the emptied storage's identity (`UntypedStorage._cdata`)
        self.entries = self._spilled.values()  # a live read-only view: the Ledger reads them as its records
        self.spilled_bytes = 0  # moved to host, over the ledger's life

    def spill(self, entries: Iterable[Any], needed: int) -> Iterator[Any]:
        """Free `needed` device bytes, or as many as can be, from `entries` (the Ledger's that only
        pack aliases hold, on the device, earliest saved first: backward needs them last): move to
        host memory each one that only the graph's saved aliases hold (anything else holding it,
        the forward's own tensor, would keep the device memory too). The storage itself is emptied,
        so every saver's alias follows it; `restore` fills it again. Yields each entry moved, for
        the Ledger to count it "spilled"."""
        for entry in entries:
            if needed <= 0:
                return
            storage = self._sole(entry.holders)
            if storage is None:
                continue
            nbytes = entry.record.nbytes
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=storage.is_cuda)
            host.untyped_storage().copy_(storage)  # synchronous: the storage is freed next
            storage.resize_(0)
            entry.spilled = (storage, host)
            self._spilled[storage._cdata] = entry
            self.spilled_bytes += nbytes
            needed -= nbytes
            yield entry

    @staticmethod
    def _sole(holders: list[weakref.ref]) -> torch.UntypedStorage | None:
        """The storage of `holders`, if they are the only tensors on it, none of them in use by
        backward (unpacked), and it can be emptied; else None."""
        tensors = [t for ref in holders if (t := ref()) is not None]
        if not tensors or any(hasattr(t, UNPACKED) for t in tensors):
            return None
        storage = tensors[0].untyped_storage()
        # one reference per tensor object on the storage, and ours, `storage`
        if not storage.resizable() or torch._C._storage_Use_Count(storage._cdata) != len(tensors) + 1:
            return None
        return storage

    def entry_of(self, storage: torch.UntypedStorage) -> Any | None:
        """The entry `spill` emptied `storage` of, if it did: backward is unpacking an alias of it."""
        return self._spilled.get(storage._cdata)

    def restore(self, entry: Any) -> None:
        """Fill `entry`'s storage again from its host copy (the Ledger has checked the capacity and
        counts it on the device again)."""
        storage, host = entry.spilled
        storage.resize_(entry.record.nbytes)
        storage.copy_(host.untyped_storage())
        del self._spilled[storage._cdata]
        entry.spilled = None

    def forget(self, entry: Any) -> None:
        """Every tensor of `entry` died while its bytes were on the host: the copy goes with it."""
        del self._spilled[entry.spilled[0]._cdata]
