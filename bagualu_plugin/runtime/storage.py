"""Storage forms of a saved tensor kept off the device as it is (paper §IV-B, DESIGN.md section 3):
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
    savers unpacking it in backward share one copy); `prefetch()` starts that early."""

    def __init__(self, flat: torch.Tensor):
        self.dtype, self.device, self.numel = flat.dtype, flat.device, flat.numel()
        self.on_device: torch.Tensor | None = None  # set when a keeping saver makes this moot
        self._restored: Callable[[], torch.Tensor | None] = lambda: None
        self._prefetched: torch.Tensor | None = None
        self.on_restore: Callable[[Stored], None] | None = None  # called at the first restore

    def restore(self) -> torch.Tensor:
        if self.on_device is not None:
            return self.on_device
        flat = self._restored()
        if flat is None:
            flat = self._prefetched if self._prefetched is not None else self._load()
            self._prefetched = None
            self._ready(flat)
            self._restored = weakref.ref(flat)
            if self.on_restore is not None:
                self.on_restore(self)
        return flat

    def prefetch(self) -> None:
        if self.on_device is None and self._prefetched is None and self._restored() is None:
            self._prefetched = self._load()

    def _ready(self, flat: torch.Tensor) -> None:
        """Make `flat` safe to read on the current stream."""

    def drop(self, flat: torch.Tensor) -> None:
        """Another saver keeps the storage on the device: serve that copy, free ours."""
        self.on_device = flat
        self._release()


def _size_class(nbytes: int) -> int:
    """Host buffer sizes: 4 KiB, then steps of 1/8 of the power of two below (<= 12.5% unused)."""
    if nbytes <= 4096:
        return 4096
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class HostPool:
    """Host buffers for offloaded storages, reused from micro-batch to micro-batch as a caching
    allocator reuses device memory: pinned on CUDA (copies out and back run on side streams and
    overlap compute), plain memory on CPU, where the same path runs synchronously. A buffer
    returns to the pool when its copy dies, and is handed out again only once the copy back to
    the device that read it has finished. The pool keeps what was once in use at the same time."""

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self.made = 0  # buffers allocated; `taken` - `made` were reused
        self.taken = 0
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of at least `nbytes`."""
        self.taken += 1
        free = self._free.get(_size_class(nbytes))
        if free:
            buffer, reading = free.pop()
            if reading is not None:
                reading.synchronize()
            return buffer
        self.made += 1
        return torch.empty(_size_class(nbytes), dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, buffer: torch.Tensor, reading: object = None) -> None:
        """Take `buffer` back; `reading`: the CUDA event of a copy still reading it, if any."""
        self._free.setdefault(buffer.numel(), []).append((buffer, reading))

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream for copies to and from `device` (one per device, reused)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


class HostCopy(Stored):
    def __init__(self, flat: torch.Tensor, ledger: Ledger, pool: HostPool):
        super().__init__(flat)
        nbytes = flat.numel() * flat.element_size()
        self.pool, self.buffer, self.loaded = pool, pool.take(nbytes), None
        self.host = self.buffer[:nbytes].view(flat.dtype)
        if flat.is_cuda:  # copy out on the side stream; the copy back waits for it
            stream = pool.stream(flat.device)
            stream.wait_stream(torch.cuda.current_stream(flat.device))
            with torch.cuda.stream(stream):
                self.host.copy_(flat, non_blocking=True)
                flat.record_stream(stream)
            self.copied = stream.record_event()
        else:
            self.host.copy_(flat)
        ledger.record(self.host, "host")

    def _load(self) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.host.clone()
        stream = self.pool.stream(self.device)
        stream.wait_event(self.copied)
        with torch.cuda.stream(stream):
            flat = self.host.to(self.device, non_blocking=True)
        self.loaded = stream.record_event()
        return flat

    def _ready(self, flat: torch.Tensor) -> None:
        if self.loaded is not None:  # made on the side stream, read on the current one
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.loaded)
            flat.record_stream(current)

    def _release(self) -> None:
        if self.buffer is not None:
            self.pool.give(self.buffer, self.loaded)
        self.buffer = self.host = None

    def __del__(self) -> None:
        self._release()


class Quantized(Stored):
    def __init__(self, flat: torch.Tensor, ledger: Ledger, block_size: int, fmt: str):
        super().__init__(flat)
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

