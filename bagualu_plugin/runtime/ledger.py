"""The activation Ledger: live bytes of the tensors the autograd graph keeps for backward.

This is the measurement the rest of the system trusts (docs/architecture.md): the cost model of
paper §IV predicts it, the planner budgets against it, and the Provisioner reads it at the end of
each forward micro-batch. So it counts storages, not tensors: views and tensors saved twice cost
their storage once, parameters and buffers (and views of them) cost nothing here because they are
static memory, and a storage stops counting the moment the last saved tensor object of it dies.

On CPU "device memory" is what this ledger counts, plus the caller's ``static_bytes``; a simulated
capacity turns "over capacity" into the same error a GPU raises (or, with ``on_overrun="record"``,
into a record read where every expert-parallel rank can agree on it). On CUDA the accounting is the
same, and the caching allocator of the model's device can be read alongside it. There the
allocator holds the source of an offload until its copy to the host has passed, so that source
counts on the device while its copy is in flight.

This module is the count only. What is not an activation (parameters, buffers, gathered shards)
is decided by the Ledger's `StaticStorages` (static_storages.py), and kept activations are moved to
host memory past ``spill_at`` and back by its `Spill` mover (spill.py): each changes for reasons of
its own, and the count changes only where the Ledger itself writes it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import nn

from .micro_batches import MicroBatches
from .spill import UNPACKED, Spill
from .static_storages import StaticStorages, StorageKey, _storage
from .static_storages import model_device as model_device  # importable from here, as before

Residency = Literal["device", "host", "spilled"]
OnOverrun = Literal["raise", "record"]
_RESIDENCIES: tuple[Residency, ...] = ("device", "host", "spilled")
_RECORDED: tuple[Residency, ...] = ("device", "host")  # what a saver keeps; "spilled" is the Ledger's own move (`Spill`)


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """Raised when keeping one more saved storage would exceed the simulated device capacity.

    A subclass of the error a GPU raises, so a policy sized too small crashes on CPU exactly where
    it would crash on a GPU (docs/architecture.md).
    """

    def __init__(self, *, capacity_bytes: int, static_bytes: int, live_bytes: int, requested_bytes: int,
                 op: object = None, micro_batch: int | None = None):
        self.capacity_bytes = capacity_bytes
        self.static_bytes = static_bytes
        self.live_bytes = live_bytes
        self.requested_bytes = requested_bytes
        self.op = op
        self.micro_batch = micro_batch
        where = "".join([f" by op {op!r}" if op is not None else "",
                         f" in micro-batch {micro_batch}" if micro_batch is not None else ""])
        needed = static_bytes + live_bytes + requested_bytes
        super().__init__(
            f"simulated out of memory: saving {requested_bytes} bytes for backward{where} needs "
            f"{needed} bytes = static {static_bytes} + live activations {live_bytes} + request "
            f"{requested_bytes}, over the simulated capacity of {capacity_bytes} bytes "
            f"({capacity_bytes - static_bytes - live_bytes} bytes free)"
        )


ALL = object()  # `Ledger.by_op`: every micro-batch
_UNKNOWN = object()  # `Ledger.pack`: the caller has not looked up the storage


class Record(NamedTuple):
    """One live saved storage and how many bytes it holds where.

    ``op`` first saved it and is charged for it; ``savers`` are all ops that saved it, in order
    (a storage saved by two ops is freed only when both are mitigated); ``source`` is what the
    ledger's ``source`` callback said made it; ``dtype`` is that of its first saved tensor.
    A named tuple: one is made for every new saved storage, on the training path.
    """

    key: StorageKey
    nbytes: int
    residency: Residency
    op: object
    micro_batch: int | None
    dtype: torch.dtype
    source: object
    savers: tuple[object, ...]


_new_record = tuple.__new__  # a Record without the Python frame of its generated __new__ (one per saved storage)


@dataclass(slots=True)
class _Live:
    record: Record
    holders: list = field(default_factory=list)  # weak references to its recorded tensor objects
    packed: bool = False  # every holder is a `Ledger.pack` alias, which `Ledger.unpack` hands to backward
    spilled: tuple[torch.UntypedStorage, torch.Tensor] | None = None  # its storage, emptied, and the host copy: the mover's (`Spill`)


class Ledger:
    """Counts the unique live storages saved for backward, per op and per micro-batch.

    ``micro_batches``: the runtime's per-micro-batch state (`MicroBatches`, a new one if not
    given); every new record is attributed to its ``running`` micro-batch, which the caller sets
    (the engine or Provisioner), and to whatever ``current_op()`` returns (an op id, hashable).
    ``source(tensor)`` names the op that made a newly saved storage (the profiler's provenance).

    ``on_overrun``: what going over the simulated capacity does. "raise" (the default) raises
    `SimulatedOutOfMemoryError` at the save that does not fit, as a GPU does. "record" keeps the
    first such error in ``overrun`` (read it with `take_overrun`) and goes on counting, so the
    step runs to its end with the capacity not enforced. Under expert parallelism every forward
    and backward of an MoE layer is a collective: a rank that raised mid-forward would leave the
    others blocked in the next all-to-all. With "record" the caller checks at a step boundary,
    with every rank at once (the demo all-reduces it), and every rank raises at the same step.

    ``spill_at``: device bytes, ``static_bytes`` included, that no new device record may take the
    count past while activations kept earlier can make room: they move to host memory first
    (`Spill.spill`), the last resort of a plan made for less than its forward keeps. None (the
    default): nothing moves, and only the capacity is enforced.

    ``device``: the compute device (saved CPU tensors count as host memory under a CUDA one, the
    allocator is read there); by default the device of the excluded parameters, looked up again
    by `refresh` (a model moved with `.cuda()` after the ledger was made): its `StaticStorages`'.

    Weakref callbacks run whenever the garbage collector or another thread drops a saved tensor, possibly
    in the middle of a ``record``. They therefore only append to a queue; every public method
    applies the queued releases under the lock before it reads or writes, so counts are exact at
    each call and never negative.
    """

    def __init__(self, *, capacity_bytes: int | None = None, static_bytes: int = 0,
                 exclude: Iterable[torch.Tensor] = (), current_op: Callable[[], object] = lambda: None,
                 source: Callable[[torch.Tensor], object] | None = None,
                 device: torch.device | str | None = None, on_overrun: OnOverrun = "raise",
                 model: nn.Module | None = None, micro_batches: MicroBatches | None = None):
        self.capacity_bytes = capacity_bytes
        self.spill_at: int | None = None
        self.on_overrun = on_overrun
        self.overrun: SimulatedOutOfMemoryError | None = None
        self.static_bytes = static_bytes
        self.current_op = current_op
        self.source = source
        self.micro_batches = MicroBatches() if micro_batches is None else micro_batches
        self._static = StaticStorages(exclude=exclude, model=model, device=device)
        # bound once, not delegated: `is_static` runs at every save, `excludes` at every save the profiler sees
        self.is_static, self.excludes = self._static.is_static, self._static.excludes
        self._mover = Spill()
        self._spilled = self._mover.entries  # the mover's, a live view: one C-level test per unpack, read as records
        self._live: dict[StorageKey, _Live] = {}
        self._in_flight: deque[tuple[int, object]] = deque()  # (bytes, event) of copies out, oldest first
        self._in_flight_bytes = 0
        self._bytes = dict.fromkeys(_RESIDENCIES, 0)
        self._peak = 0
        self._released: deque[tuple[_Live, weakref.ref]] = deque()
        self._charges: dict[StorageKey, tuple[object, weakref.ref]] = {}  # `charge`'s, until the tensor dies
        self._decoder: dict[int | None, int] = {}  # device bytes per micro-batch charged past the embedding (`decoder_bytes`)
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model: nn.Module, **kw) -> Ledger:
        """A ledger that never counts ``model``'s parameters and buffers (static memory), whatever
        wraps or replaces them after it was made (DDP, FSDP2: see `refresh`)."""
        return cls(model=model, **kw)

    @property
    def modules(self) -> frozenset[nn.Module]:
        """The model's modules at the last walk (`refresh`): a new set only when they changed."""
        return self._static.modules

    @property
    def device(self) -> torch.device:
        """The compute device (the class docstring's ``device``), as its static storages last found it."""
        return self._static.device

    @property
    def spilled_bytes(self) -> int:
        """Moved to host by the mover (`spill_at`), over the ledger's life."""
        return self._mover.spilled_bytes

    def refresh(self) -> None:
        """Walk the model again (`StaticStorages.refresh`): its parameters and buffers, whatever
        moved, wrapped or replaced them since, are static memory, and its device the ledger's."""
        self._static.refresh()

    def refresh_if_changed(self) -> bool:
        """`refresh()` if a parameter or buffer may have changed since the last walk
        (`StaticStorages.changed`); whether it walked."""
        if self._static.changed():
            self.refresh()
            return True
        return False

    # ------------------------------------------------------------------ recording

    @contextlib.contextmanager
    def track(self) -> Iterator[Ledger]:
        """Record every tensor saved for backward inside the block (`pack` / `unpack` below).

        Innermost hooks win: inside offload/fp8/checkpoint hooks those record for themselves.
        """
        self.refresh_if_changed()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self

    def pack(self, tensor: torch.Tensor, found: tuple[StorageKey, int] | None = _UNKNOWN) -> tuple[torch.Tensor, int]:
        """Keep `tensor` for backward as it is, and count it. `found`: its `_storage`, where the
        caller has it already (the plan's hooks: this runs for every saved tensor).

        The pack keeps a detached alias (same storage, same values): keeping the tensor itself
        would tie a saved output to its own grad_fn in a cycle the garbage collector cannot break
        (torch's saved_tensors_hooks docs), and the alias dies exactly when the graph drops it,
        whoever else still holds the original. torch skips its in-place modification check for
        hooked saved tensors, so `unpack` repeats it: tracking must never change gradients.
        A parameter is static memory wherever it is saved (also a weight a sharding engine gathered
        outside its module's forward, as TRL's fused head gathers the LM head's) and is kept as
        itself: a leaf makes no cycle, and an engine finds its own marks on it in backward
        (DeepSpeed ZeRO-3's `ds_status`, which TRL's fused head reads to gather it again).
        """
        if isinstance(tensor, nn.Parameter):
            return tensor, tensor._version
        alias = tensor.detach()
        if found is _UNKNOWN:
            found = _storage(alias)
        if found is not None:
            self._record(alias, found[0], found[1], "host" if self._static.host_apart and alias.is_cpu else "device", packed=True)
        return alias, alias._version

    def unpack(self, packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        alias, version = packed
        # backward computes with it now: the graph is no longer its only user
        if self.spill_at is not None and not isinstance(alias, nn.Parameter):
            setattr(alias, UNPACKED, True)  # the mover's mark, set here: no call more per unpack
            if self._spilled:
                self._restore(alias)
        if alias._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a {alias.dtype} tensor of shape {tuple(alias.shape)} was saved "
                f"at version {version} and is now at version {alias._version}"
            )
        return alias

    def charge(self, tensor: torch.Tensor, op: object) -> None:
        """Charge `tensor`'s storage to `op` when it is first recorded, whichever op saves it then:
        what every decoder layer receives (RoPE tables, masks) is made before the layers and
        saved in them, and the cost model charges it where it is made. Forgotten when `tensor`
        dies (its address may be reused)."""
        found = _storage(tensor)
        if found is None or found[0] in self._charges:
            return
        key = found[0]

        def forget(ref: weakref.ref) -> None:
            if self._charges.get(key, (None, None))[1] is ref:
                del self._charges[key]

        self._charges[key] = (op, weakref.ref(tensor, forget))

    def end_charges(self) -> None:
        """The decoder layers are done: an argument they received that is first saved after them
        (the loss's token count, which the Trainer passes through the layers) is its saver's."""
        self._charges.clear()

    def record(self, tensor: torch.Tensor, residency: Residency = "device") -> None:
        """Charge the storage of ``tensor`` until every recorded tensor object of it has died.

        The first record of a storage charges its full nbytes (a view keeps all of it alive) to the
        current op and micro-batch; later records of the same live storage add nothing. Offload and
        fp8 hooks call this for the form they keep (host copy, fp8 payload). Over the simulated
        capacity it raises before counting anything (``on_overrun="record"``: records the error
        and counts it).
        """
        if residency not in _RECORDED:
            raise ValueError(f"residency must be one of {_RECORDED}, got {residency!r}")
        found = _storage(tensor)
        if found is not None:
            self._record(tensor, found[0], found[1], residency)

    def _record(self, tensor: torch.Tensor, key: StorageKey, nbytes: int, residency: Residency, packed: bool = False) -> None:
        """`record` of a storage found already: the path every saved tensor takes. `packed`:
        `tensor` is a `pack` alias."""
        # callbacks run before the lock is taken: they may read the ledger
        charged = self._charges.get(key) if self._charges else None
        op = self.current_op() if charged is None else charged[0]
        source = None if self.source is None else self.source(tensor)
        micro_batch = self.micro_batches.running
        with self._lock:
            if self._released or self._in_flight:
                self._apply_releases()
            if self.is_static(key):
                return
            entry = self._live.get(key)
            if entry is None:
                if residency == "device":
                    self._check_capacity(nbytes, op, micro_batch)
                entry = _Live(_new_record(Record, (key, nbytes, residency, op, micro_batch, tensor.dtype, source, (op,))), packed=packed)
                self._live[key] = entry
                self._bytes[residency] += nbytes
                if residency == "device":
                    self._count_layer(micro_batch, op, nbytes)
                    self._peak = max(self._peak, self._bytes["device"] + self._in_flight_bytes)
            else:
                entry.packed = entry.packed and packed
                if op not in entry.record.savers:
                    entry.record = entry.record._replace(savers=(*entry.record.savers, op))
            # a weakref callback (not weakref.finalize, 25x dearer): called once, when `tensor` dies
            entry.holders.append(weakref.ref(tensor, lambda ref, entry=entry: self._released.append((entry, ref))))

    def retire(self, micro_batch: int) -> None:
        """`micro_batch` was abandoned (its output never went backward, or its step raised): what
        its graph still keeps, while someone holds it, stays counted, as no micro-batch's, so that
        the next micro-batch of that index is measured from nothing."""
        with self._locked():
            for entry in (*self._live.values(), *self._spilled):
                record = entry.record
                if record.micro_batch == micro_batch:
                    entry.record = record._replace(micro_batch=None)
                    if record.residency == "device":
                        self._count_layer(micro_batch, record.op, -record.nbytes)
                        self._count_layer(None, record.op, record.nbytes)

    def kept(self, key: StorageKey) -> bool:
        """Whether a saved tensor of this storage lives on the device now (a saver kept it as it is)."""
        with self._locked():
            entry = self._live.get(key)
            return entry is not None and entry.record.residency == "device"

    def in_flight(self, tensor: torch.Tensor, done: object) -> None:
        """Count the storage of `tensor`, a source being copied off the device, on the device until
        `done` (a CUDA event: anything with `query()` and `synchronize()`) has completed: the
        caching allocator keeps it that long, even when every tensor of it has died."""
        found = _storage(tensor)
        if found is None:
            return
        with self._locked():
            self._in_flight.append((found[1], done))
            self._in_flight_bytes += found[1]
            self._peak = max(self._peak, self._bytes["device"] + self._in_flight_bytes)

    @property
    def in_flight_bytes(self) -> int:
        with self._locked():
            return self._in_flight_bytes

    def wait_in_flight(self, limit: int) -> None:
        """Wait on the host for the oldest copies until at most `limit` bytes are in flight (the
        only way to bound what the allocator holds when copies fall behind compute)."""
        while True:
            with self._locked():
                if self._in_flight_bytes <= limit or not self._in_flight:
                    return
                oldest = self._in_flight[0][1]
            oldest.synchronize()

    @property
    def on_overrun(self) -> OnOverrun:
        return self._on_overrun

    @on_overrun.setter
    def on_overrun(self, mode: OnOverrun) -> None:
        if mode not in ("raise", "record"):
            raise ValueError(f"on_overrun must be 'raise' or 'record', got {mode!r}")
        self._on_overrun = mode

    def take_overrun(self) -> SimulatedOutOfMemoryError | None:
        """The first save over the simulated capacity since the last call (``on_overrun="record"``;
        None if there was none), forgotten here."""
        with self._lock:
            overrun, self.overrun = self.overrun, None
        return overrun

    # ------------------------------------------------------------------ reading

    @property
    def live_device_bytes(self) -> int:
        """Saved storages on the device, plus sources of copies still in flight."""
        with self._locked():
            return self._bytes["device"] + self._in_flight_bytes

    @property
    def live_host_bytes(self) -> int:
        """Host copies: the savers' (offload) and the Ledger's own (`spill_at`)."""
        with self._locked():
            return self._bytes["host"] + self._bytes["spilled"]

    @property
    def peak_device_bytes(self) -> int:
        """Max over time of ``live_device_bytes`` (activations only, not ``static_bytes``)."""
        with self._locked():
            return self._peak

    def reset_peak(self, allocator: bool = True) -> None:
        """Restart the peak from now, the allocator's too on CUDA (`max_allocated_bytes`) unless
        `allocator` is False."""
        with self._locked():
            self._peak = self._bytes["device"] + self._in_flight_bytes
        if allocator and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def decoder_bytes(self, micro_batch: int | None) -> int:
        """Device bytes of `micro_batch` charged to the blocks past its embedding, kept as records
        come and go: cheap enough to read at every gate, where they are the bytes of the gate's
        layer and of those before it."""
        with self._lock:  # not `_locked()`: a generator's enter and exit at every gate cost more than the count
            self._apply_releases()
            return self._decoder.get(micro_batch, 0)

    def by_op(self, residency: Residency = "device", micro_batch: object = ALL) -> dict[object, int]:
        """Bytes per op charged, of every micro-batch (`ALL`) or of `micro_batch` only."""
        return self._group(lambda r: r.op, residency, None if micro_batch is ALL else lambda r: r.micro_batch == micro_batch)

    def by_micro_batch(self, residency: Residency = "device") -> dict[int | None, int]:
        return self._group(lambda r: r.micro_batch, residency)

    def records(self) -> list[Record]:
        """Live records, in the order their storages were first recorded (those on the device or
        the savers' host copies), then those spilled (`spill_at`)."""
        with self._locked():
            return [entry.record for entry in (*self._live.values(), *self._spilled)]

    def allocated_bytes(self) -> int:
        """Bytes held by the CUDA caching allocator on this device (everything, not activations)."""
        return torch.cuda.memory_allocated(self._cuda_device("allocated_bytes"))

    def max_allocated_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self._cuda_device("max_allocated_bytes"))

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._apply_releases()
            yield

    def _apply_releases(self) -> None:
        while self._in_flight and self._in_flight[0][1].query():  # copies complete in order
            self._in_flight_bytes -= self._in_flight.popleft()[0]
        while self._released:
            entry, ref = self._released.popleft()
            entry.holders.remove(ref)
            if not entry.holders:
                record = entry.record
                if record.residency == "spilled":
                    self._mover.forget(entry)
                else:  # evict, so that a new storage at the same address is a new record
                    evicted = self._live.pop(record.key)
                    assert evicted is entry, record
                self._bytes[record.residency] -= record.nbytes
                assert self._bytes[record.residency] >= 0, self._bytes
                if record.residency == "device":
                    self._count_layer(record.micro_batch, record.op, -record.nbytes)

    def _count_layer(self, micro_batch: int | None, op: object, nbytes: int) -> None:
        """`decoder_bytes`' count of `micro_batch` moved by `nbytes` where `op` is a decoder
        layer's or the head's (block -1 is the embedding; at a gate the head has not run, nor the
        layers after the gate's); an entry at 0 goes."""
        layer = getattr(op, "layer", None)
        if layer is None or layer < 0:
            return
        total = self._decoder.get(micro_batch, 0) + nbytes
        if total:
            self._decoder[micro_batch] = total
        else:
            del self._decoder[micro_batch]

    def _check_capacity(self, nbytes: int, op: object, micro_batch: int | None) -> None:
        live = self._bytes["device"] + self._in_flight_bytes
        if self.spill_at is not None and self.static_bytes + live + nbytes > self.spill_at:
            # what only pack aliases hold (`unpack` brings it back), on the device, earliest saved first
            kept = (entry for entry in list(self._live.values()) if entry.packed and entry.record.residency == "device")
            for entry in self._mover.spill(kept, self.static_bytes + live + nbytes - self.spill_at):
                record = entry.record
                del self._live[record.key]
                entry.record = record._replace(residency="spilled")
                self._move(entry, record.nbytes, "device", "spilled")
            live = self._bytes["device"] + self._in_flight_bytes
        if self.capacity_bytes is not None and self.static_bytes + live + nbytes > self.capacity_bytes:
            fields = dict(
                capacity_bytes=self.capacity_bytes, static_bytes=self.static_bytes, live_bytes=live,
                requested_bytes=nbytes, op=op, micro_batch=micro_batch,
            )
            # raised as made: an error held in a local of this frame would keep the frame (and the
            # forward's tensors above it) alive through the traceback's reference cycle
            if self._on_overrun == "raise":
                raise SimulatedOutOfMemoryError(**fields)
            if self.overrun is None:  # "record": the first one, the save that would have failed
                self.overrun = SimulatedOutOfMemoryError(**fields)

    def _restore(self, alias: torch.Tensor) -> None:
        """Backward unpacks `alias`: if the mover moved its storage to the host, it comes back (the
        capacity checked first, as for any device record: others may spill to make room)."""
        storage = alias.untyped_storage()
        with self._locked():
            entry = self._mover.entry_of(storage)
            if entry is None:
                return
            record = entry.record
            self._check_capacity(record.nbytes, record.op, record.micro_batch)
            self._mover.restore(entry)
            if self._released:  # a storage that died before the new memory took its address
                self._apply_releases()
            key = (storage.device, storage.data_ptr())
            entry.record = record._replace(key=key, residency="device")
            self._live[key] = entry
            self._move(entry, record.nbytes, "spilled", "device")
            self._peak = max(self._peak, self._bytes["device"] + self._in_flight_bytes)

    def _move(self, entry: _Live, nbytes: int, before: Residency, after: Residency) -> None:
        self._bytes[before] -= nbytes
        self._bytes[after] += nbytes
        self._count_layer(entry.record.micro_batch, entry.record.op, nbytes if after == "device" else -nbytes)

    def _group(self, by: Callable[[Record], object], residency: Residency, only: Callable[[Record], bool] | None = None) -> dict:
        if residency not in _RESIDENCIES:
            raise ValueError(f"residency must be one of {_RESIDENCIES}, got {residency!r}")
        out: dict = {}
        with self._locked():
            for entry in (self._spilled if residency == "spilled" else self._live.values()):  # in place: this runs after every forward
                record = entry.record
                if record.residency == residency and (only is None or only(record)):
                    group = by(record)
                    out[group] = out.get(group, 0) + record.nbytes
        return out

    def _cuda_device(self, what: str) -> torch.device:
        if self.device.type != "cuda":
            raise RuntimeError(
                f"Ledger.{what}() reads the CUDA caching allocator, which is only read on CUDA; this "
                f"ledger is on {self.device}: use live_device_bytes/peak_device_bytes, which count the "
                "simulated device memory on CPU"
            )
        return self.device
