"""What a per-operator mitigation plan does to one block's memory and time (paper §IV-B, §V-A).

Strategies act on the tensors an operator saves for backward:

- keep: the saver holds the tensor on the device;
- recompute: the recomputed operators are covered by the block's recompute units (the whole layer,
  its MoE block, attention as a whole, single ops), largest first, and what remains by spans
  (attention, the MoE block: `graph.standard_spans`); each is one checkpoint region: tensors its
  recomputed ops save that were made inside it are dropped, its inputs are held, and in backward
  its forward runs again (Δt_b grows by the Δt_f of all its ops, a span's too: an upper bound,
  torch stops replaying after the last dropped save);
- offload: the saver's copy lives on the host; one copy out in forward, one back in backward;
  tensors below `offload_min_bytes` stay on the device;
- fp8: the saver holds an e4m3 copy with one FP32 scale per block, cast in forward and back in
  backward; integer tensors stay as they are.

With `loss_chunk_tokens` the head's LM head and loss run as one chunked linear + cross-entropy:
the head's tensors are those of that path (`TensorSpec.chunked`), and backward replays the LM
head's forward, chunk by chunk, to rebuild the logits it never kept.

Memory is counted per storage, as the runtime keeps it: one form per storage. If any holder keeps it
at full precision on the device, that copy serves every holder, and offload or FP8 requested by
another holder buys nothing (the conflicts of §V-A: such a candidate saves no memory); otherwise
the first holder in program order that offloads or quantises decides the form for all.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import wraps
from types import MappingProxyType
from typing import Literal, TypeVar

import numpy as np

from ..hardware import HardwareSpec
from .graph import BlockGraph, OpSpec, TensorSpec
from .linear import LinearForm, Load
from .roofline import cast_kernel, fp8_stored_bytes, offload_copy
from .symbolic import FormLoad, Sym, total

Strategy = Literal["keep", "recompute", "offload", "fp8"]
STRATEGIES: tuple[str, ...] = Strategy.__args__
MITIGATIONS: tuple[str, ...] = STRATEGIES[1:]


_R = TypeVar("_R")
_MEMO_ENTRIES = 4096  # per function; emptied when full


def memoised(fn: Callable[..., _R]) -> Callable[..., _R]:
    """`fn(block, ...)` remembered per block object and arguments (a plan by its items): a pure
    function of its arguments, asked the same questions every micro-batch (the calibration after
    each forward, the gates' expected bytes, the planner). The entry holds its block, so no other
    block can take its id. On a load of forms (`FormLoad`, one planner path's), the entry is kept
    on that load and goes with it: a shape's paths come and go, the memo's size stays."""
    memo: dict[tuple, tuple[BlockGraph, _R]] = {}

    @wraps(fn)
    def remembered(block: BlockGraph, *rest):
        forms = next((a for a in rest if isinstance(a, FormLoad)), None)
        store = memo if forms is None else forms.memo
        key = (id(block), *(frozenset(a.items()) if isinstance(a, dict) else a for a in rest))  # a plan is a dict
        if forms is not None:
            key = (remembered, *key)
        hit = store.get(key)
        if hit is not None and hit[0] is block:
            return hit[1]
        result = fn(block, *rest)
        if len(store) >= _MEMO_ENTRIES:
            store.clear()
        store[key] = (block, result)
        return result

    return remembered


@dataclass(frozen=True)
class MitigationOptions:
    fp8_block_size: int = 128
    offload_min_bytes: int = 0
    quant_format: str = "fp8_e4m3"  # or "int8": same bytes, one byte per element plus block scales
    loss_chunk_tokens: int | None = None  # LM head + loss in chunks of this many tokens; None: HF's loss

    def __post_init__(self) -> None:
        chunk = self.loss_chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
            raise ValueError(f"loss_chunk_tokens must be a positive integer or None, got {chunk!r}")


@dataclass(frozen=True)
class Footprint:
    """Saved activations of one forward micro-batch and the time its mitigation adds.

    `offload_peaks`: the two largest amounts one op brings back to full precision in backward,
    its host copies and its fp8 copies dequantized. An op's copies come back while the op before
    it is prefetched, so at most two ops' are on the device at once: `reload_bytes`, room the
    micro-batch's backward needs beyond what it keeps. `transient_bytes`: what a block saves for a
    moment in the forward and frees before the forward ends (`BlockGraph.transient`), room needed
    then, before any backward: `room_bytes` is the larger of the two."""

    device_bytes: float = 0.0
    host_bytes: float = 0.0
    forward_extra_s: float = 0.0
    backward_extra_s: float = 0.0
    offload_peaks: tuple[float, ...] = ()
    transient_bytes: float = 0.0

    def repeated(self, n: int) -> Footprint:
        """The footprint of `n` blocks alike, one after another."""
        return Footprint(
            self.device_bytes * n, self.host_bytes * n, self.forward_extra_s * n, self.backward_extra_s * n,
            _two_largest(self.offload_peaks * min(n, 2)), self.transient_bytes,
        )

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(
            self.device_bytes + other.device_bytes,
            self.host_bytes + other.host_bytes,
            self.forward_extra_s + other.forward_extra_s,
            self.backward_extra_s + other.backward_extra_s,
            _two_largest(self.offload_peaks + other.offload_peaks),
            max(self.transient_bytes, other.transient_bytes),  # blocks' forwards end one after another
        )

    @property
    def reload_bytes(self) -> float:
        return sum(self.offload_peaks)

    @property
    def room_bytes(self) -> float:
        """Room the micro-batch needs beyond what it keeps: at its forward's end, or in its backward."""
        return max(self.reload_bytes, self.transient_bytes)

    @property
    def needed_bytes(self) -> float:
        """What the micro-batch needs on the device: what it keeps, and room for a moment's saves
        and to bring its copies back."""
        return self.device_bytes + self.room_bytes


def _two_largest(values: Sequence[float]) -> tuple[float, ...]:
    """The two largest positive values; a form (`costmodel.symbolic`) counts as positive: one
    that is 0 at some shapes (the bytes past a threshold) adds nothing there."""
    return tuple(sorted((v for v in values if isinstance(v, Sym) or v > 0), reverse=True)[:2])


@dataclass(frozen=True)
class Region:
    """One checkpoint: it replays `ops` (a recompute unit or a span) and drops the saves of
    `dropped` (all of `ops` for a unit); the other ops save as if it were not there."""

    ops: tuple[str, ...]
    dropped: tuple[str, ...]


def cover(
    units: Sequence[tuple[str, ...]], spans: Sequence[tuple[str, ...]], wanted: set[str], kind: str
) -> list[Region]:
    """The checkpoint regions that together recompute exactly `wanted`: whole recompute units,
    largest first, then one region per span for the rest, which takes over the units inside the
    span (regions never nest, so a replay runs every module inside it as its forward did); an op
    that neither covers is an error that names the units to use."""
    wanted, regions = set(wanted), []
    for unit in sorted(units, key=len, reverse=True):
        if set(unit) <= wanted:
            regions.append(Region(unit, unit))
            wanted -= set(unit)
    for span in spans:
        if wanted & set(span):
            inside = [r for r in regions if set(r.ops) < set(span)]
            dropped = wanted | {op for r in inside for op in r.ops}
            regions = [r for r in regions if r not in inside] + [Region(span, tuple(o for o in span if o in dropped))]
            wanted -= set(span)
    if wanted:
        options = ", ".join("+".join(u) for u in units if set(u) & wanted)
        raise ValueError(f"{kind} block: {sorted(wanted)} cannot be recomputed alone; recompute units: {options or 'none'}")
    return regions


def recompute_regions(block: BlockGraph, plan: Mapping[str, str]) -> list[Region]:
    """The checkpoint regions that realise the plan's recomputed ops in `block` (with its
    collective unit, which a plan recomputes only where every rank does)."""
    units = (*block.recompute_units, block.collective) if block.collective else block.recompute_units
    return cover(units, block.spans, {op for op, s in plan.items() if s == "recompute"}, block.kind)


def holding_regions(block: BlockGraph, plan: Mapping[str, str], chunked: bool = False) -> list[Region]:
    """The regions that hold their inputs: those whose ops save something (a frozen weight too, a
    tensor of no bytes here). The graph keeps a checkpoint alive through the saves made inside it
    only (a span's other saves, which it sends on, as well), so one that saved nothing (frozen ops
    before the first LoRA adapter, whose outputs need no gradient) lets its inputs go at once. The
    tables every layer receives (`TensorSpec.shared`) are saved by the layers that use them,
    whichever block holds them."""
    saves = [set(t.savers) for t in block.path_tensors(chunked) if not t.shared]
    return [r for r in recompute_regions(block, plan) if any(s & set(r.ops) for s in saves)]


def stored_form(tensor: TensorSpec, plan: Mapping[str, str], region_of: Mapping[str, frozenset[str]], large: bool) -> str | None:
    """How the runtime keeps one saved storage: "device" (full precision), "fp8", "offload", or
    None when every saver recomputes it. `large`: it has at least `offload_min_bytes` (a smaller
    one an offloading saver keeps)."""
    if tensor.shared:
        return "device"
    device, other = False, None
    for saver in tensor.savers:
        strategy = plan.get(saver, "keep")
        if strategy == "recompute":
            device |= tensor.producer not in region_of[saver]  # a region input is held as it is
        elif strategy == "offload" and large:
            other = other or "offload"
        elif strategy == "fp8" and tensor.floating:
            other = other or "fp8"
        else:
            device = True
    return "device" if device else other


def _check_plan(block: BlockGraph, plan: Mapping[str, str]) -> None:
    unknown = set(plan) - set(block.op_names)
    if unknown:
        raise KeyError(f"plan names ops {sorted(unknown)} that a {block.kind} block lacks")
    bad = {s for s in plan.values() if s not in STRATEGIES}
    if bad:
        raise ValueError(f"unknown strategies {sorted(bad)}; expected one of {STRATEGIES}")


def _regions(block: BlockGraph, plan: Mapping[str, str], chunked: bool, tensors: Sequence[TensorSpec]):
    """The plan's checkpoint regions in `block`: each recomputed op's region (its replayed ops),
    each held input and the first op of the region that holds it, the ops replayed."""
    present = {t.name for t in tensors}
    produced_by = {t.name: t.producer for t in tensors}
    region_of: dict[str, frozenset[str]] = {}  # a recomputed op -> the ops its region replays
    held: dict[str, str] = {}  # a tensor a checkpoint region keeps as its input -> that region's first op
    replayed: list[OpSpec] = []
    order = block.op_names
    for region in holding_regions(block, plan, chunked):
        members = frozenset(region.ops)
        for name in region.dropped:
            region_of[name] = members
        first = min(members, key=order.index)
        for op in block.ops:
            if op.name in members:
                replayed.append(op)
                for t in op.inputs:
                    if t in present and produced_by[t] not in members:
                        held[t] = min(held.get(t, first), first, key=order.index)
    return region_of, held, replayed


@dataclass(frozen=True)
class _Layout:
    """What a plan does to one block's saved tensors whatever the load (`footprint`'s first half):
    the tensors the block counts (not the layer arguments, which the model counts), each one's
    form at `offload_min_bytes` or more and below it, with the op that brings it back where it is
    offloaded or cast (the first such saver), the ops its regions replay, and the regions
    (`_regions`)."""

    tensors: tuple[TensorSpec, ...]
    forms: tuple[tuple[str | None, str | None], ...]  # (at least offload_min_bytes, below)
    makers: tuple[dict[str, str], ...]  # form -> its maker
    replayed: tuple[OpSpec, ...]
    chunked: bool
    region_of: Mapping[str, frozenset[str]]
    held: Mapping[str, str]


@memoised
def _layout(block: BlockGraph, plan: Mapping[str, str], options: MitigationOptions) -> _Layout:
    _check_plan(block, plan)
    chunked = _chunked(block, options)
    every = block.path_tensors(chunked)
    region_of, held, replayed = _regions(block, plan, chunked, every)
    tensors = tuple(t for t in every if not t.held_by)  # whether a region holds a layer argument is decided in other blocks
    forms = tuple(
        ("device", "device") if t.name in held else (stored_form(t, plan, region_of, True), stored_form(t, plan, region_of, False))
        for t in tensors
    )
    makers = tuple(
        {form: next(s for s in t.savers if plan.get(s) == form) for form in set(pair) if form in ("fp8", "offload")}
        for t, pair in zip(tensors, forms)
    )
    return _Layout(tensors, forms, makers, tuple(replayed), chunked, region_of, held)


@dataclass(frozen=True)
class _AtLeast:
    """x where it is at least `bound`, else 0 (elementwise): the bytes of a tensor an offloading
    saver moves to the host, which stays on the device below `offload_min_bytes`."""

    bound: float

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.where(x >= self.bound, x, 0.0)


class _Prices:
    """One block's per-tensor quantities at one load, made as first asked (`footprint`'s second
    half sums them): sizes, the bytes an offload or cast takes (all of a tensor, or what is at
    least `offload_min_bytes` where an offloading saver would keep it below), their FP8 copies and
    the casts' and copies' times. Numbers, or forms of the shape whose functions of one form (the
    threshold, FP8's blocks, a roofline's time) are variables of the shape: no branch recorded."""

    def __init__(self, block: BlockGraph, load: Load, hw: HardwareSpec, options: MitigationOptions):
        self.load, self.options = load, options
        self.copy, self.cast = offload_copy(hw), cast_kernel(hw)
        self._made: dict[tuple, object] = {}
        self.transient = block.transient.at(load)

    def _get(self, key: tuple, make: Callable[[], object]) -> object:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def size(self, t: TensorSpec) -> object:
        return self._get(("size", t.name), lambda: t.bytes(self.load))

    def large(self, t: TensorSpec) -> object:
        """Its bytes where they reach `offload_min_bytes`, else 0."""
        def make():
            size, bound = self.size(t), self.options.offload_min_bytes
            return size.apply(_AtLeast(bound)) if isinstance(size, Sym) else (size if size >= bound else 0.0)

        return self._get(("large", t.name), make)

    def stored(self, t: TensorSpec, whole: bool) -> object:
        """The FP8 copy of its bytes (`whole`), or of `large`'s."""
        moved = self.size(t) if whole else self.large(t)
        return self._get(("stored", t.name, whole), lambda: fp8_stored_bytes(moved / t.dtype_bytes, self.options.fp8_block_size))

    def cast_s(self, t: TensorSpec, whole: bool) -> object:
        moved = self.size(t) if whole else self.large(t)
        return self._get(("cast", t.name, whole), lambda: self.cast.time(moved + self.stored(t, whole)))

    def copy_s(self, t: TensorSpec, whole: bool) -> object:
        moved = self.size(t) if whole else self.large(t)
        return self._get(("copy", t.name, whole), lambda: self.copy.time(moved))


@memoised
def _prices(block: BlockGraph, load: Load, hw: HardwareSpec, options: MitigationOptions) -> _Prices:
    return _Prices(block, load, hw, options)


@memoised
def footprint(
    block: BlockGraph,
    plan: Mapping[str, str],
    load: Load,
    hw: HardwareSpec,
    options: MitigationOptions = MitigationOptions(),
) -> Footprint:
    """Device and host bytes of `block` under `plan` (op name -> strategy; absent = keep)."""
    layout, prices = _layout(block, plan, options), _prices(block, load, hw, options)
    kept, host, extra = [], [], []
    # bytes each op brings back to full precision in backward: its host copies (the first
    # offloading saver makes the copy) and its fp8 copies (the first quantising saver), each
    # restored beside what the device keeps while the op's backward uses it
    restored: dict[str, list] = {}
    for t, (large, small), makers in zip(layout.tensors, layout.forms, layout.makers):
        whole = large == small  # else an offloading saver keeps it below offload_min_bytes: it is split by its size
        moved = prices.size(t) if whole else prices.large(t)
        if not whole:
            kept.append(prices.size(t) - moved)
        if large == "device":
            kept.append(moved)
        elif large == "fp8":
            kept.append(prices.stored(t, whole))
            extra.append(prices.cast_s(t, whole))
            restored.setdefault(makers[large], []).append(moved)
        elif large == "offload":
            host.append(moved)
            extra.append(prices.copy_s(t, whole))
            restored.setdefault(makers[large], []).append(moved)
    replay = [op.forward_s.at(load) for op in layout.replayed]
    if layout.chunked:
        replay.append(block.op("lm_head").forward_s.at(load))
    moving = total(extra)
    peaks = _two_largest([total(sizes) for sizes in restored.values()])
    return Footprint(total(kept), total(host), moving, total([moving, *replay]), peaks, prices.transient)


def device_bytes_by_op(
    block: BlockGraph, plan: Mapping[str, str], load: Load, options: MitigationOptions = MitigationOptions()
) -> Mapping[str, float]:
    """`footprint`'s device bytes of `block` per op, charged as the Ledger charges a storage: to
    the op that first puts it on the device in program order (the first saver that keeps it, or
    the first of a region that holds it as input; the first quantising saver for an fp8 copy;
    the table's maker for the tables every layer receives). What the regions of later blocks
    hold of the layer arguments is not included (`CostModel.device_bytes_by_op` adds it).
    Remembered: read it, never change it."""
    return MappingProxyType(_device_bytes_by_op(block, plan, load, options))


@memoised
def _device_bytes_by_op(block: BlockGraph, plan: Mapping[str, str], load: Load, options: MitigationOptions) -> dict[str, float]:
    charges, out = _charges(block, plan, options), {}
    for t, (large, small) in zip(charges.tensors, charges.charges):
        size = t.bytes(load)
        charge = large if size >= options.offload_min_bytes else small
        if charge is not None:
            op, form = charge
            if form == "fp8":
                size = fp8_stored_bytes(t.elements.at(load), options.fp8_block_size)
            out[op] = out.get(op, 0.0) + size
    return out


@memoised
def charged_form(block: BlockGraph, plan: Mapping[str, str], ops: Collection[str], options: MitigationOptions) -> LinearForm | None:
    """The device bytes `device_bytes_by_op` charges to `ops` under `plan`, as one form of the
    load, where they are linear in it: no tensor of the block is offloaded or cast to FP8 (whose
    thresholds and blocks are not). None where they are not. What the Provisioner weighs at each
    gate, one product for any shape."""
    forms = _charges(block, plan, options).forms
    if forms is None:
        return None
    return sum((forms[op] for op in ops if op in forms), LinearForm())


@dataclass(frozen=True)
class _Charges:
    """Where `device_bytes_by_op` charges each saved tensor under one plan, whatever the load
    (its plan-only half): the tensors the block counts, each one's (op, form) at
    `offload_min_bytes` or more and below it (None: not on the device), and the bytes per op
    as forms where that makes them linear in the load."""

    tensors: tuple[TensorSpec, ...]
    charges: tuple[tuple[tuple[str, str] | None, tuple[str, str] | None], ...]
    forms: Mapping[str, LinearForm] | None


@memoised
def _charges(block: BlockGraph, plan: Mapping[str, str], options: MitigationOptions) -> _Charges:
    layout = _layout(block, plan, options)
    region_of, held, order = layout.region_of, layout.held, block.op_names

    def charge(t: TensorSpec, form: str | None, large: bool) -> tuple[str, str] | None:
        if form == "fp8":
            return next(s for s in t.savers if plan.get(s) == "fp8"), form
        if form != "device":
            return None
        keepers = [held[t.name]] if t.name in held else []
        for saver in () if t.shared else t.savers:
            strategy = plan.get(saver, "keep")
            if strategy == "recompute":
                if t.producer not in region_of[saver]:
                    keepers.append(min(region_of[saver], key=order.index))
            elif strategy not in ("offload", "fp8") or (strategy == "offload" and not large) or (strategy == "fp8" and not t.floating):
                keepers.append(saver)
        return (min(keepers, key=order.index) if keepers else t.savers[0]), form

    charges = tuple((charge(t, large, True), charge(t, small, False)) for t, (large, small) in zip(layout.tensors, layout.forms))
    forms: dict[str, LinearForm] | None = {}
    for t, (large, small) in zip(layout.tensors, charges):
        if large != small or (large is not None and large[1] == "fp8"):
            forms = None
            break
        if large is not None:
            forms[large[0]] = forms.get(large[0], LinearForm()) + t.elements * t.dtype_bytes
    return _Charges(layout.tensors, charges, forms)


def _chunked(block: BlockGraph, options: MitigationOptions) -> bool:
    chunked = block.kind == "head" and options.loss_chunk_tokens is not None
    if chunked and not any(t.chunked for t in block.tensors):
        raise ValueError(
            "loss_chunk_tokens is set, but this head block has no tensors of the chunked loss "
            "(a cost model saved before the chunked loss existed: build or profile it again)"
        )
    return chunked
