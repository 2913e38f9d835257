"""Per-operator mitigation of saved activations, installed for the forward passes inside
`apply_plan` (paper §IV-B, §V-A; DESIGN.md section 4).

- keep: the Ledger's pack (a detached alias, counted on the device);
- offload: a copy of the saved tensor's whole storage in a reused host buffer (`HostPool`: pinned,
  copied on a side stream on CUDA; plain memory and synchronous on CPU), restored as the same
  view in backward, the op before prefetched while an op's backward runs;
- fp8: the storage quantised blockwise (`bagualu_plugin.kernels`), dequantised in backward;
- recompute: the op's recompute unit (`costmodel.graph.standard_units`) runs under a non-reentrant
  checkpoint: a module's forward, or an expert op through the experts' runner. An op no unit
  covers alone (attention's three, Qwen2-MoE's gated shared expert) goes through its span
  (`standard_spans`): the attention module's or MoE block's forward under a checkpoint that takes
  only the recomputed ops' saves. A region's inputs stay on the device, as the cost model holds them.

One storage has one form, whoever saves it: savers share a host copy or a quantised payload, and
when one saver keeps the storage on the device every other saver uses that copy, so mitigation
never leaves two copies (the conflicts of §V-A cost nothing but save nothing; `find_conflicts`
reports them so a planner can avoid them).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from .. import kernels
from ..adapters import Adapter, OpTracker, is_inside_backward, shared_arguments
from ..adapters.experts import IMPLEMENTATION, RUNNER_ATTR
from ..costmodel import CostModel, ModelDims, OpId
from ..costmodel.graph import ATTENTION_OPS, EXPERT_OPS, standard_spans, standard_units
from ..costmodel.mitigation import MitigationOptions, cover
from ..costmodel.conflicts import Conflict, conflicts
from ..costmodel.plan import Plan
from .ledger import Ledger, StorageKey, _storage

# ------------------------------------------------------------------------------------------------
# one storage, kept in one form


class _Stored:
    """A device storage kept elsewhere, shared by every saver of it. `restore()` gives the whole
    storage back on the device as a flat tensor of the saved dtype (reused while alive, so two
    savers unpacking it in backward share one copy); `prefetch()` starts that early."""

    def __init__(self, flat: torch.Tensor):
        self.dtype, self.device, self.numel = flat.dtype, flat.device, flat.numel()
        self.on_device: torch.Tensor | None = None  # set when a keeping saver makes this moot
        self._restored: Callable[[], torch.Tensor | None] = lambda: None
        self._prefetched: torch.Tensor | None = None
        self.on_restore: Callable[[_Stored], None] | None = None  # called at the first restore

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


class _HostCopy(_Stored):
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


class _Quantized(_Stored):
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
class _View:
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


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole storage as a 1-D tensor of its dtype (views keep all of it alive)."""
    storage = tensor.untyped_storage()
    return tensor.new_empty(0).set_(storage, 0, (storage.nbytes() // tensor.element_size(),), (1,))


@dataclass
class _Offloads:
    """The host copies one op made in one micro-batch's forward, after those of the op before."""

    op: OpId | None
    before: _Offloads | None
    copies: list = field(default_factory=list)  # weak references: backward frees them

    def prefetch_before(self, _restored: _Stored) -> None:
        if self.before is not None:
            for ref in self.before.copies:
                copy = ref()
                if copy is not None:
                    copy.prefetch()


class SavedTensorHooks:
    """pack/unpack for `torch.autograd.graph.saved_tensors_hooks`: each saved tensor is kept,
    offloaded or quantised as the plan says for the op running when it is saved."""

    def __init__(
        self, plan: Plan, ledger: Ledger, current_op: Callable[[], OpId | None], options: MitigationOptions, pool: HostPool
    ):
        self.plan, self.ledger, self.current_op, self.options, self.pool = plan, ledger, current_op, options, pool
        self._last_offload: dict[int | None, _Offloads] = {}  # per micro-batch: its latest op's host copies
        self._forms: dict[StorageKey, tuple[str, object, weakref.ref]] = {}  # live storages this plan has packed

    def layer_inputs(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A decoder layer's forward pre-hook: what every layer receives (RoPE tables, masks) is
        kept as it is, as the cost model assumes (`TensorSpec.shared`)."""
        for t in shared_arguments(args, kwargs):
            found = _storage(t)
            if found is not None and found[0] not in self._forms:
                self._remember(t, found[0], "keep", None)

    def pack(self, tensor: torch.Tensor):
        op = self.current_op()
        strategy = self.plan.strategy(op) if op is not None else "keep"
        found = _storage(tensor)
        if found is None or strategy in ("keep", "recompute") or self.ledger.excludes(tensor):
            return self._keep(tensor, found)  # recompute: a held region input; parameters stay
        key, nbytes = found
        if strategy == "offload" and nbytes < self.options.offload_min_bytes:
            return self._keep(tensor, found)
        if strategy == "fp8" and not tensor.is_floating_point():
            return self._keep(tensor, found)
        form, stored, _ = self._forms.get(key, (None, None, None))
        if form == "keep":  # another saver keeps it on the device: share that copy
            return "keep", self.ledger.pack(tensor)
        if stored is None:
            flat = _flat(tensor)
            if strategy == "offload":
                stored = self._offload(flat, op)
            else:
                stored = _Quantized(flat, self.ledger, self.options.fp8_block_size, self.options.quant_format)
            # While the base tensor object lives, so does its storage: no other storage can take
            # its address. (The saved object itself may be a temporary view autograd made.)
            self._remember(tensor._base if tensor._base is not None else tensor, key, strategy, stored)
        view = _View(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor._version, weakref.ref(tensor))
        return "stored", (stored, view)

    def _offload(self, flat: torch.Tensor, op: OpId) -> _HostCopy:
        """A host copy, grouped with the other copies `op` makes in this micro-batch: restoring
        the first of a group (backward reached that op) prefetches the group of the op before it,
        so its copies come back while this op's backward runs."""
        copy = _HostCopy(flat, self.ledger, self.pool)
        mb = self.ledger.micro_batch
        group = self._last_offload.get(mb)
        if group is None or group.op != op:
            group = self._last_offload[mb] = _Offloads(op, before=group)
        group.copies.append(weakref.ref(copy))
        copy.on_restore = group.prefetch_before
        return copy

    def _keep(self, tensor: torch.Tensor, found):
        packed = self.ledger.pack(tensor)
        if found is not None:
            key = found[0]
            form, stored, _ = self._forms.get(key, (None, None, None))
            if isinstance(stored, _Stored) and stored.on_device is None:
                stored.drop(_flat(tensor))  # a keeping saver makes the earlier copy moot
            if form != "keep":
                self._remember(packed[0], key, "keep", None)  # the alias lives as long as the graph keeps it
        return "keep", packed

    def _remember(self, owner: torch.Tensor, key: StorageKey, form: str, stored: object) -> None:
        """Remember the storage's form until `owner` dies (while it lives, the storage lives).
        The entry holds the weakref whose callback forgets it (cheaper than weakref.finalize,
        and this runs for every new saved storage)."""

        def forget(_ref):
            if self._forms.get(key) is token:
                del self._forms[key]

        token = (form, stored, weakref.ref(owner, forget))
        self._forms[key] = token

    def unpack(self, packed):
        kind, payload = packed
        if kind == "keep":
            return self.ledger.unpack(payload)
        stored, view = payload
        return view.of(stored.restore())


# ------------------------------------------------------------------------------------------------
# recompute units


def unit_module(adapter: Adapter, layer: int, unit: tuple[str, ...]) -> nn.Module | None:
    """The module whose forward runs `unit` (a recompute unit or a span); None for the expert ops
    (run by the runner)."""
    if layer == -1:
        return adapter.decoder.embed_tokens
    if layer == adapter.head_index:
        return adapter.decoder.norm if unit == ("final_norm",) else adapter.model.lm_head
    part = adapter.layers[layer]
    if set(unit) == set(adapter.layer_ops(part)):
        return part.module
    if unit[0] in ATTENTION_OPS:
        return part.module.self_attn
    if unit == EXPERT_OPS:
        return part.experts
    single = {
        "attn_norm": part.module.input_layernorm,
        "mlp_norm": part.module.post_attention_layernorm,
        "router": part.router,
        "dense_mlp": part.module.mlp,
        "shared_expert": part.shared[0] if part.shared else None,
    }
    if len(unit) == 1 and unit[0] in single:
        return single[unit[0]]
    if len(unit) == 1 and unit[0].startswith("expert_"):
        return None
    return part.module.mlp  # the MoE block: router, experts, shared expert


def _block(adapter: Adapter, layer: int) -> tuple[str, tuple[str, ...]]:
    """The block's kind and ops, as the cost model names them."""
    if layer == -1:
        return "embed", ("embed",)
    if layer == adapter.head_index:
        return "head", ("final_norm", "lm_head", "loss")
    part = adapter.layers[layer]
    return "moe" if part.moe else "dense", tuple(adapter.layer_ops(part))


def block_units(adapter: Adapter, layer: int) -> tuple[tuple[str, ...], ...]:
    """The block's recompute units, as the analytic and profiled cost models have them."""
    kind, ops = _block(adapter, layer)
    return standard_units(kind, ops, shared_alone=len(adapter.family.shared) <= 1)


def block_spans(adapter: Adapter, layer: int) -> tuple[tuple[str, ...], ...]:
    """The block's spans, as the analytic and profiled cost models have them."""
    return standard_spans(*_block(adapter, layer))


@contextmanager
def _bagualu_experts(config) -> Iterator[None]:
    """The "bagualu" experts implementation for the duration of the block: the one a checkpoint
    recorded with, also when it recomputes after `apply_plan` has restored the model's own."""
    previous = config._experts_implementation_internal
    config._experts_implementation_internal = IMPLEMENTATION
    try:
        yield
    finally:
        config._experts_implementation_internal = previous


def _same(x):
    return x


def _top_hooks() -> tuple[Callable, Callable]:
    """The saved-tensor hooks in force now (a checkpoint's, the plan's); none: save as autograd does."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) or (_same, _same)


class _SpanSaves:
    """Where the saves inside a span's checkpoint go when it recomputes only some of the span's ops
    (`costmodel.graph.standard_spans`): the dropped ops' saves to the checkpoint, which replays the
    span in backward; every other save where it would go without the checkpoint (the plan's
    hooks, so the Ledger counts it and the plan keeps, offloads or quantises it).

    The forward tells the ops apart by the op scope at each save, and the dropped set is read
    live, so a gate that escalates the MoE block's experts mid-forward still drops their saves.
    The replay repeats the forward's decisions in save order: it may run after `apply_plan` has
    removed the op scopes; there the other ops' saves stay with the replay's own graph, which
    backward discards. Why not torch's selective checkpointing: it caches op outputs outside the
    saved-tensor hooks, where the Ledger would not see them, and every output, saved or not."""

    def __init__(self, dropped: Callable[[], bool]):
        self.dropped = dropped
        self.outside = _top_hooks()  # taken before the checkpoint pushes its own
        self.decisions: list[bool] | None = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        checkpoint_pack, checkpoint_unpack = _top_hooks()
        if self.decisions is None:
            decisions = self.decisions = []
            pack_outside, unpack_outside = self.outside

            def decide() -> bool:
                decisions.append(self.dropped())
                return decisions[-1]

        else:
            replay = iter(self.decisions)
            pack_outside = unpack_outside = _same

            def decide() -> bool:
                return next(replay, True)  # more saves than the forward made: torch's check says so

        def pack(tensor: torch.Tensor):
            if decide():
                return True, checkpoint_pack(tensor)
            return False, pack_outside(tensor)

        def unpack(packed):
            dropped, payload = packed
            return checkpoint_unpack(payload) if dropped else unpack_outside(payload)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def _recompute(module: nn.Module, forward: Callable, config, args: tuple, kwargs: dict, saves: Callable = nullcontext):
    """`forward(*args, **kwargs)` of `module` run under a non-reentrant checkpoint, its saves
    routed by `saves()` (a `_SpanSaves`; by default all are the checkpoint's).

    Every tensor the forward receives, keyword arguments and tuples (RoPE tables) included, is
    handed to the checkpoint positionally: the checkpoint saves its positional tensors for
    backward, where the Ledger sees them, and would hold the rest unseen. The recomputation in
    backward runs the experts as the forward did, even after the runtime has been removed.
    """
    if any(kwargs.get(name) is not None for name in ("cache", "past_key_values", "past_key_value")):
        raise ValueError(
            f"{type(module).__name__} is recomputed but received a KV cache, which recomputation would "
            "update twice; train with use_cache=False"
        )
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def run(*tensors):
        filled = list(leaves)
        for i, t in zip(where, tensors):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        with _bagualu_experts(config), saves():
            return forward(*a, **kw)

    return checkpoint(run, *(leaves[i] for i in where), use_reentrant=False)


class PlanRuntime:
    """The mitigation mechanisms installed on a model once, following a plan that may change
    between micro-batches and even within one, at the gate (deferred planning, paper §V-A):
    every recompute unit's and span's module is wrapped and every experts module gets a runner,
    each checking the current plan when it runs; saved tensors are handled inside `forward()`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        ledger: Ledger | None = None,
        options: MitigationOptions = MitigationOptions(),
        capacity_bytes: int | None = None,
        static_bytes: int = 0,
    ):
        """`ledger`: count into this one; otherwise a new Ledger of the model with the given
        (simulated) capacity and static bytes."""
        self.adapter = Adapter(model)
        self.options = options
        self.tracker = OpTracker(self.adapter)
        self.ledger = ledger or Ledger.for_model(
            self.adapter.model,
            capacity_bytes=capacity_bytes,
            static_bytes=static_bytes,
            current_op=lambda: self.tracker.current,
        )
        cuda = any(p.is_cuda for p in self.adapter.model.parameters())
        self.hooks = SavedTensorHooks(Plan(), self.ledger, lambda: self.tracker.current, options, HostPool(pinned=cuda))
        self._regions: set[tuple[int, tuple[str, ...]]] = set()
        self._ops = frozenset(self.adapter.ops())  # set_plan runs per micro-batch: list them once
        self._stack: ExitStack | None = None

    @property
    def plan(self) -> Plan:
        return self.hooks.plan

    def set_plan(self, plan: Mapping) -> None:
        """Follow `plan` from now on (validated first: unknown ops, units that cannot recompute)."""
        plan = plan if isinstance(plan, Plan) else Plan(plan)
        unknown = [str(op) for op in plan if op not in self._ops]
        if unknown:
            raise KeyError(f"plan names ops this {self.adapter.family.model_type} model does not have: {', '.join(unknown)}")
        regions = {}
        for layer in {op.layer for op in plan if plan[op] == "recompute"}:
            wanted = {op.name for op in plan if op.layer == layer and plan[op] == "recompute"}
            units, spans = block_units(self.adapter, layer), block_spans(self.adapter, layer)
            for region in cover(units, spans, wanted, f"layer {layer}"):
                regions[(layer, region.ops)] = frozenset(region.dropped)
        self._regions, self.hooks.plan = regions, plan

    def install(self) -> PlanRuntime:
        a, stack = self.adapter, ExitStack()
        stack.enter_context(_bagualu_experts(a.config))
        if a.config.use_cache:  # a KV cache would be updated again by recomputation
            a.config.use_cache = False
            stack.callback(setattr, a.config, "use_cache", True)
        self.tracker.install()
        stack.callback(self.tracker.remove)
        for layer in [-1, *(part.index for part in a.layers), a.head_index]:
            for unit in dict.fromkeys((*block_units(a, layer), *block_spans(a, layer))):
                module = unit_module(a, layer, unit)
                if module is not None:  # expert ops have no module: the runner checkpoints them
                    self._wrap(module, layer, unit, stack)
        for part in a.layers:
            if part.experts is not None:
                setattr(part.experts, RUNNER_ATTR, self._runner(part.index))
                stack.callback(delattr, part.experts, RUNNER_ATTR)
            stack.callback(part.module.register_forward_pre_hook(self.hooks.layer_inputs, with_kwargs=True).remove)
        self._stack = stack
        return self

    def _wrap(self, module: nn.Module, layer: int, unit: tuple[str, ...], stack: ExitStack) -> None:
        """Route `module`'s forward through a checkpoint while its unit or span is a recompute
        region. Regions never nest, so a module that a region's replay runs again ran plainly in
        the forward; it does so again, whatever the plan is by then (in 1F1B the next micro-batch
        is planned before this one's backward)."""
        had, previous = "forward" in module.__dict__, module.__dict__.get("forward")
        forward = module.forward
        config = self.adapter.config

        def dropped() -> bool:
            op = self.tracker.current
            return op is not None and op.layer == layer and op.name in self._regions.get((layer, unit), ())

        def dispatch(*args, **kwargs):
            region = self._regions.get((layer, unit))
            if region is None or is_inside_backward():
                return forward(*args, **kwargs)
            saves = nullcontext if region == set(unit) else _SpanSaves(dropped)
            with self._holding():
                return _recompute(module, forward, config, args, kwargs, saves)

        module.forward = dispatch
        stack.callback(lambda: setattr(module, "forward", previous) if had else delattr(module, "forward"))

    def _holding(self):
        """While the plan's hooks are in force, a region's inputs stay on the device as they are,
        as the cost model holds them, whatever op runs when the region begins and saves them (a
        MoE block begins in mlp_norm, a layer in the previous layer's last op, a span in its first
        op, any of which the plan may offload)."""
        if _top_hooks()[0] != self.hooks.pack:
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.hooks._keep(t, _storage(t)), self.hooks.unpack)

    def _runner(self, layer: int):
        def run(name, op, experts, *args, **kwargs):
            if (layer, (name,)) in self._regions and not is_inside_backward():
                return checkpoint(op, experts, *args, use_reentrant=False, **kwargs)
            return op(experts, *args, **kwargs)

        return run

    @contextmanager
    def forward(self) -> Iterator[Ledger]:
        """The saved-tensor hooks for the forward passes inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self.hooks.pack, self.hooks.unpack):
            yield self.ledger

    def remove(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


@contextmanager
def apply_plan(
    model: nn.Module,
    plan: Mapping,
    *,
    ledger: Ledger | None = None,
    options: MitigationOptions = MitigationOptions(),
) -> Iterator[Ledger]:
    """Install `plan` for the forward passes inside the block and yield the Ledger that counts
    what they save (DESIGN.md section 4). Backward may run inside or after the block. On exit
    every hook, wrapper and setting is removed, also when the body raises."""
    runtime = PlanRuntime(model, ledger=ledger, options=options)
    runtime.set_plan(plan)  # validated before anything is installed
    runtime.install()
    try:
        with runtime.forward() as counted:
            yield counted
    finally:
        runtime.remove()


def model_cost(model: nn.Module) -> CostModel:
    """The analytic cost model of a supported HF model, in its dtype and attention kernel (its
    graphs name the same tensors the model saves; benchmarks/costmodel_accuracy.py checks it)."""
    adapter = Adapter(model)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[next(adapter.model.parameters()).dtype]
    dims = ModelDims.from_hf_config(adapter.config, dtype=dtype, attention=adapter.config._attn_implementation)
    return CostModel.from_config(dims, "cpu")


def find_conflicts(plan: Mapping, model: nn.Module | CostModel) -> list[Conflict]:
    """`bgl.find_conflicts`: the §V-A conflicts of `plan` on a supported HF model (its analytic
    cost model names the same tensors the model saves) or on a cost model."""
    return conflicts(plan if isinstance(plan, Plan) else Plan(plan), model if isinstance(model, CostModel) else model_cost(model))
