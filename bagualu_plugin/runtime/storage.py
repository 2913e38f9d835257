"""Storage forms of a saved tensor kept off the device as it is (paper §IV-B, docs/architecture.md):
a host copy in a reused host buffer (`HostPool`: pinned, copied on a side stream on CUDA; plain
memory and synchronous on CPU) or a blockwise-quantised payload (`bagualu_plugin.kernels`). Each
form holds a whole storage, so every saver of it shares one copy; a `SavedView` rebuilds a saver's
tensor over the restored storage.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import kernels
from .ledger import Ledger


class Stored:
    """A device storage kept elsewhere, shared by every saver of it. `restore()` gives the whole
    storage back on the device as a flat tensor of the saved dtype (reused while alive, so two
    savers unpacking it in backward share one copy); `prefetch()` starts that early. The Ledger
    counts the restored copy on the device while it lives."""

    def __init__(self, flat: torch.Tensor, ledger: Ledger):
        self.dtype, self.device, self.numel = flat.dtype, flat.device, flat.numel()
        self.ledger = ledger
        self.on_device: torch.Tensor | None = None  # set when a keeping saver makes this moot
        self._restored: Callable[[], torch.Tensor | None] = lambda: None
        self._prefetched: torch.Tensor | None = None
        self.on_restore: Callable[[Stored], None] | None = None  # called at the first restore

    def restore(self) -> torch.Tensor:
        if self.on_device is not None:
            return self.on_device
        flat = self._restored()
        first = flat is None
        if first:
            flat = self._prefetched if self._prefetched is not None else self._bring()
            self._prefetched = None
            self._restored = weakref.ref(flat)
        self._ready(flat)  # every saver: it may read on another stream than the one before
        if first and self.on_restore is not None:
            self.on_restore(self)
        return flat

    def prefetch(self) -> None:
        if self.on_device is None and self._prefetched is None and self._restored() is None:
            self._prefetched = self._bring()

    def _bring(self) -> torch.Tensor:
        flat = self._load()
        self.ledger.record(flat)
        return flat

    def _ready(self, flat: torch.Tensor) -> None:
        """Make `flat` safe to read on the current stream."""

    def drop(self, flat: torch.Tensor) -> None:
        """Another saver keeps the storage on the device: serve that copy, free ours."""
        self.on_device = flat
        self._release()


def _size_class(nbytes: int, pinned: bool) -> int:
    """Host buffer sizes. Pinned: powers of two, as torch's pinned allocator rounds them anyway.
    Plain: 4 KiB, then steps of 1/8 of the power of two below (<= 12.5% unused)."""
    if nbytes <= 4096:
        return 4096
    if pinned:
        return 1 << (nbytes - 1).bit_length()
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class HostPool:
    """Host buffers for offloaded storages, reused from micro-batch to micro-batch as a caching
    allocator reuses device memory: pinned for CUDA sources (decided per copy, so a model moved
    to the GPU after the runtime was built still copies asynchronously), plain memory for CPU
    ones, where the same path runs synchronously.

    Routing changes the sizes of expert activations every micro-batch, so a request takes the
    smallest free buffer that fits (up to twice its size class), and free buffers beyond
    `max_free_bytes` are let go, largest first. A buffer comes back with the event of the last copy
    that touched it; the next copy into it waits for that event on its own stream (no host wait).
    Copies out and back run on two side streams per device, so neither direction queues behind
    the other. More than `max_in_flight_bytes` of copies out make the host wait for the oldest."""

    def __init__(self, max_free_bytes: int = 16 << 30, max_in_flight_bytes: int = 4 << 30):
        self.max_free_bytes, self.max_in_flight_bytes = max_free_bytes, max_in_flight_bytes
        self.made = 0  # buffers allocated; `taken` - `made` were reused
        self.taken = 0
        self.free_bytes = 0
        self._free: dict[tuple[bool, int], list[tuple[torch.Tensor, object]]] = {}
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

    def take(self, nbytes: int, pinned: bool) -> tuple[torch.Tensor, object]:
        """A uint8 host buffer of at least `nbytes`, and the event of the last copy that touched
        it (None if none may still run): write into it only after that event."""
        self.taken += 1
        size = _size_class(nbytes, pinned)
        fits = [c for p, c in list(self._free) if p == pinned and size <= c <= 2 * size]
        if fits:
            key = (pinned, min(fits))
            free = self._free[key]
            buffer, done = free.pop()
            if not free:
                del self._free[key]
            self.free_bytes -= buffer.numel()
            return buffer, done
        self.made += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=pinned), None

    def give(self, buffer: torch.Tensor, pinned: bool, done: object = None) -> None:
        """Take `buffer` back; `done`: the event of the last copy touching it, if any."""
        self._free.setdefault((pinned, buffer.numel()), []).append((buffer, done))
        self.free_bytes += buffer.numel()
        while self.free_bytes > self.max_free_bytes:  # torch's pinned allocator waits for its copies
            key = max(self._free, key=lambda k: k[1])
            dropped, _ = self._free[key].pop()
            if not self._free[key]:
                del self._free[key]
            self.free_bytes -= dropped.numel()

    def stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        """The side stream for copies "out" of or "in" to `device` (one each per device, reused)."""
        key = (device, direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]


class HostCopy(Stored):
    def __init__(self, flat: torch.Tensor, ledger: Ledger, pool: HostPool):
        super().__init__(flat, ledger)
        nbytes = flat.numel() * flat.element_size()
        self.pool, self.pinned = pool, flat.is_cuda
        self.buffer, previous = pool.take(nbytes, self.pinned)
        self.host = self.buffer[:nbytes].view(flat.dtype)
        self.copied = self.loaded = None  # events of the copy out and of the copy back
        if flat.is_cuda:  # copy out on the side stream, after what made `flat` and what last read the buffer
            stream = pool.stream(flat.device, "out")
            stream.wait_stream(torch.cuda.current_stream(flat.device))
            if previous is not None:
                stream.wait_event(previous)
            with torch.cuda.stream(stream):
                self.host.copy_(flat, non_blocking=True)
            flat.record_stream(stream)
            self.copied = stream.record_event()
            ledger.in_flight(flat, self.copied)
            ledger.wait_in_flight(pool.max_in_flight_bytes)
        else:
            self.host.copy_(flat)
        ledger.record(self.host, "host")

    def _load(self) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.host.clone()
        # Allocated on the compute stream, where it is read and freed: a tensor allocated on a side
        # stream would keep its own pool there. The copy waits for the compute kernels queued
        # before (they may still use that memory) and for the copy out.
        current = torch.cuda.current_stream(self.device)
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        stream = self.pool.stream(self.device, "in")
        stream.wait_stream(current)
        stream.wait_event(self.copied)
        with torch.cuda.stream(stream):
            flat.copy_(self.host, non_blocking=True)
        flat.record_stream(stream)
        self.loaded = stream.record_event()
        return flat

    def _ready(self, flat: torch.Tensor) -> None:
        if self.loaded is not None:  # written on the side stream, read on the current one
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.loaded)
            flat.record_stream(current)

    def _release(self) -> None:
        if self.buffer is not None:  # the copy back waited for the copy out: its event is the last
            self.pool.give(self.buffer, self.pinned, self.loaded if self.loaded is not None else self.copied)
        self.buffer = self.host = None

    def __del__(self) -> None:
        self._release()


class Quantized(Stored):
    def __init__(self, flat: torch.Tensor, ledger: Ledger, block_size: int, fmt: str):
        super().__init__(flat, ledger)
        self.q = kernels.quantize(flat, block_size, fmt)
        ledger.record(self.q.payload)
        ledger.record(self.q.scales)

    def _load(self) -> torch.Tensor:
        return kernels.dequantize(self.q)

    def _release(self) -> None:
        self.q = None


@dataclass(frozen=True)
class SavedView:
    """Where a saved tensor sits in its storage, to rebuild it over a restored flat copy."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    version: int
    source: weakref.ref

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        saved = self.source()
        if saved is not None and saved._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a {flat.dtype} tensor of shape {self.size} was saved at version {self.version} "
                f"and is now at version {saved._version}"
            )
        return flat.as_strided(self.size, self.stride, self.offset)


def whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole storage as a 1-D tensor of its dtype (views keep all of it alive)."""
    storage = tensor.untyped_storage()
    return tensor.new_empty(0).set_(storage, 0, (storage.nbytes() // tensor.element_size(),), (1,))

