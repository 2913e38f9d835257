"""The plan's saved-tensor hooks (paper §V-A): each tensor an op saves for backward is kept,
offloaded or quantised as the plan says for the op running when it is saved.

One storage has one form, whoever saves it: savers share a host copy or a quantised payload, and
when one saver keeps the storage on the device (the Ledger holds it there) every other saver uses
that copy, so mitigation never leaves two copies (the conflicts of §V-A cost nothing but save
nothing; `find_conflicts` reports them so a planner can avoid them). Offloaded copies are grouped
per op, so that restoring an op's first copy in backward prefetches the copies of the op before
it; the chain of groups starts again with each forward (micro-batch ids repeat every iteration).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..adapters import shared_arguments
from ..costmodel import OpId
from ..costmodel.mitigation import MitigationOptions
from ..costmodel.plan import Plan
from .ledger import Ledger, StorageKey, _storage
from .storage import HostCopy, HostPool, Quantized, SavedView, Stored, whole_storage


@dataclass
class _Offloads:
    """The host copies one op made in one micro-batch's forward, after those of the op before."""

    op: OpId | None
    before: _Offloads | None
    copies: list = field(default_factory=list)  # weak references: backward frees them

    def prefetch(self) -> None:
        for ref in self.copies:
            copy = ref()
            if copy is not None:
                copy.prefetch()

    def prefetch_before(self, _restored: Stored) -> None:
        if self.before is not None:
            self.before.prefetch()


class SavedTensorHooks:
    """pack/unpack for `torch.autograd.graph.saved_tensors_hooks`: each saved tensor is kept,
    offloaded or quantised as the plan says for the op running when it is saved."""

    def __init__(
        self, plan: Plan, ledger: Ledger, current_op: Callable[[], OpId | None], options: MitigationOptions, pool: HostPool
    ):
        self.plan, self.ledger, self.current_op, self.options, self.pool = plan, ledger, current_op, options, pool
        # live storages offloaded or quantised, and the layers' shared arguments (kept): (form, a
        # weak reference to their Stored, or None, the owner's weak reference). The savers' packs
        # hold the Stored, so a storage that outlives its micro-batch's backward (a cached position
        # index) does not keep its copy. Storages kept as they are need no entry: the Ledger has them.
        self._forms: dict[StorageKey, tuple[str, weakref.ref | None, weakref.ref]] = {}

    def new_forward(self, *_) -> None:
        """The model's forward pre-hook: this micro-batch's offloads start a new chain, so that
        prefetch never reaches into another forward (one abandoned before its backward too)."""
        state = self.ledger.micro_batches.get(self.ledger.micro_batches.running)
        if state is not None:
            state.offloads = None

    def prefetch(self, micro_batch: int | None, layer: int) -> None:
        """Start bringing back the host copies `layer`'s ops made in `micro_batch`'s latest forward,
        ahead of its backward (`PlanRuntime.recover`); those backward has restored are gone."""
        state = self.ledger.micro_batches.get(micro_batch)
        group = None if state is None else state.offloads
        while group is not None:
            if group.op is not None and group.op.layer == layer:
                group.prefetch()
            group = group.before

    def layer_inputs(self, args: tuple, kwargs: dict, made_by: OpId | None) -> None:
        """Before a decoder layer's forward: what every layer receives (RoPE tables, masks) is kept
        as it is, as the cost model assumes (`TensorSpec.shared`), and charged to the op that made
        it, `made_by`, as the cost model charges it."""
        for t in shared_arguments(args, kwargs):
            found = _storage(t)
            if found is not None and found[0] not in self._forms:
                self._remember(t, found[0], "keep", None)
                self.ledger.charge(t, made_by)

    def pack(self, tensor: torch.Tensor):
        op = self.current_op()
        strategy = self.plan.strategy(op) if op is not None else "keep"
        found = _storage(tensor)
        if found is None or strategy in ("keep", "recompute") or isinstance(tensor, torch.nn.Parameter) or self.ledger.is_static(found[0]):
            return self.keep(tensor, found)  # recompute: a held region input; parameters stay
        key, nbytes = found
        if strategy == "offload" and nbytes < self.options.offload_min_bytes:
            return self.keep(tensor, found)
        if strategy == "fp8" and not tensor.is_floating_point():
            return self.keep(tensor, found)
        form, stored = self._form(key)
        if form == "keep":  # another saver keeps it on the device: share that copy
            return "keep", self.ledger.pack(tensor, found)
        if stored is None:
            flat = whole_storage(tensor)
            if strategy == "offload":
                stored = self._offload(flat, op)
            else:
                stored = Quantized(flat, self.ledger, self.options.fp8_block_size, self.options.quant_format)
            # While the base tensor object lives, so does its storage: no other storage can take
            # its address. (The saved object itself may be a temporary view autograd made.)
            self._remember(tensor._base if tensor._base is not None else tensor, key, strategy, stored)
        view = SavedView(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor._version, weakref.ref(tensor))
        return "stored", (stored, view)

    def _offload(self, flat: torch.Tensor, op: OpId) -> HostCopy:
        """A host copy, grouped with the other copies `op` makes in this micro-batch: restoring
        the first of a group (backward reached that op) prefetches the group of the op before it,
        so its copies come back while this op's backward runs."""
        copy = HostCopy(flat, self.ledger, self.pool)
        state = self.ledger.micro_batches.of(self.ledger.micro_batches.running)
        group = state.offloads
        if group is None or group.op != op:
            group = state.offloads = _Offloads(op, before=group)
        group.copies.append(weakref.ref(copy))
        copy.on_restore = group.prefetch_before
        return copy

    def keep(self, tensor: torch.Tensor, found):
        """Keep `tensor` on the device; a copy an earlier saver made of it goes (the path of every
        save where nothing is mitigated: one dictionary read beyond the Ledger's count)."""
        packed = self.ledger.pack(tensor, found)
        remembered = self._forms.get(found[0]) if found is not None and self._forms else None
        if remembered is not None and remembered[1] is not None:
            stored = remembered[1]()
            if stored is not None and stored.on_device is None:
                stored.drop(whole_storage(tensor))  # a keeping saver makes the earlier copy moot
        return "keep", packed

    def _form(self, key: StorageKey) -> tuple[str | None, Stored | None]:
        """The storage's form ("keep" while the Ledger holds a saved tensor of it on the device)
        and its Stored while some saver still holds it."""
        if self.ledger.kept(key):
            return "keep", None
        form, stored, _ = self._forms.get(key, (None, None, None))
        return form, stored() if stored is not None else None

    def _remember(self, owner: torch.Tensor, key: StorageKey, form: str, stored: Stored | None) -> None:
        """Remember the storage's form until `owner` dies (while it lives, the storage lives).
        The entry holds the weakref whose callback forgets it (cheaper than weakref.finalize,
        and this runs for every new saved storage)."""

        def forget(_ref):
            if self._forms.get(key) is token:
                del self._forms[key]

        token = (form, None if stored is None else weakref.ref(stored), weakref.ref(owner, forget))
        self._forms[key] = token

    def unpack(self, packed):
        kind, payload = packed
        if kind == "keep":
            return self.ledger.unpack(payload)
        stored, view = payload
        return view.of(stored.restore())

