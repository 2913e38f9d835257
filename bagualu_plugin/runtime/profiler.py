"""`bgl.profile`: fit the cost model of paper §IV to a real model by running it.

A few forward/backward passes at different token counts, sequence lengths and (under expert
parallelism, `bgl.expert_parallel`) local routed pairs. In each, the Ledger records every saved storage with the op that
saved it, the op that made it and its size; wall clocks time each op forward (op-scope changes)
and backward (autograd node hooks). `costmodel.fit` turns the samples into operator graphs whose
bytes are exact and whose times are least-squares fits, for loads never profiled.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from tqdm.auto import tqdm

from ..adapters import Adapter, OpTracker, shared_arguments
from ..adapters.experts import RUNNER_ATTR
from ..adapters.gate import GateMonitor, RoutingSkew
from ..adapters.units import block_kind, block_spans, block_units, unit_module
from ..costmodel.fit import BlockSample, TensorSample, fit_block
from ..costmodel.graph import INPUT, LOSS_OPS, OpId, standard_spans, standard_units
from ..costmodel.linear import Load
from ..costmodel.model import CostModel
from ..hardware import HardwareSpec, preset
from .chunked_loss import chunked_causal_lm_loss
from .ledger import Ledger


def _ptr(t: object) -> int | None:
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
        return t.untyped_storage().data_ptr()
    return None


def _clock(device: torch.device) -> Callable[[], float]:
    """Wall seconds once `device` has run what was queued on it: CUDA runs kernels asynchronously,
    so without the synchronisation an op's time would be its kernels' launches (a profile is a
    one-off measurement, which the synchronisations do not disturb)."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


class _Provenance(TorchFunctionMode):
    """Which op made each storage (a torch function's new outputs), and, when timing backward,
    which op each autograd node belongs to."""

    def __init__(self, tracker: OpTracker, backward_s: dict[OpId, float] | None = None, now: Callable[[], float] = time.perf_counter):
        super().__init__()
        self.tracker, self.now = tracker, now
        self.made: dict[int, tuple[OpId | None, object]] = {}
        self.backward_s = backward_s
        self._timed: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = self.tracker.current
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            ptr = _ptr(t)
            if ptr is None or ptr in inputs:  # views and in-place results are not new storages
                continue
            token = object()
            self.made[ptr] = (op, token)
            weakref.finalize(t, self._forget, ptr, token)
            if self.backward_s is not None and t.grad_fn is not None and id(t.grad_fn) not in self._timed:
                self._time(t.grad_fn, op)
        return out

    def _forget(self, ptr: int, token: object) -> None:
        if self.made.get(ptr, (None, None))[1] is token:
            del self.made[ptr]

    def _time(self, node, op: OpId) -> None:
        self._timed.add(id(node))
        start = [0.0]
        acc = self.backward_s

        def pre(_grad_outputs):
            start[0] = self.now()

        def post(_grad_inputs, _grad_outputs):
            acc[op] = acc.get(op, 0.0) + self.now() - start[0]

        node.register_prehook(pre)
        node.register_hook(post)

    def source(self, tensor: torch.Tensor) -> OpId | None:
        return self.made.get(_ptr(tensor), (None, None))[0]


class _ForwardClock:
    """Seconds spent in each op during forward: an op runs from its scope's start to the next."""

    def __init__(self, tracker: OpTracker, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self.seconds: dict[OpId, float] = {}
        self.order: list[OpId] = []
        self._last: tuple[OpId, float] | None = None
        tracker.listeners.append(self.enter)

    def enter(self, op: OpId) -> None:
        now = self._close()
        if op not in self.seconds:
            self.order.append(op)
            self.seconds[op] = 0.0
        self._last = (op, now)

    def _close(self) -> float:
        """Charge the running op up to now; returns now."""
        now = self.now()
        if self._last is not None:
            prev, since = self._last
            self.seconds[prev] += now - since
        return now

    def stop(self) -> None:
        self._close()
        self._last = None


@contextmanager
def _instrumented(adapter: Adapter):
    """The model as the plugin runs it: "bagualu" experts (fc1 / act / fc2), op scopes and gate
    counts; everything is restored on exit."""
    model = adapter.model
    previous = adapter.config._experts_implementation
    with ExitStack() as stack:
        model.set_experts_implementation("bagualu")
        stack.callback(model.set_experts_implementation, previous)
        tracker = OpTracker(adapter).install()
        stack.callback(tracker.remove)
        monitor = stack.enter_context(GateMonitor(adapter, per_expert=False))
        yield tracker, monitor


def _skewed(adapter: Adapter, skew: float | None):
    """Under expert parallelism, every rank moves `skew` of its routed pairs to rank 0's experts:
    rank 0's local pairs grow by (ep - 1) x skew of the balanced share, every other rank's shrink by
    skew, so they vary apart from the tokens on every rank. Nothing without a group or a skew."""
    group = adapter.expert_group
    if group is None or skew is None:
        return nullcontext()
    return RoutingSkew(adapter, skew, ep_size=group.size, ep_rank=0)


def _check_token_counts(token_counts: Sequence[int], max_positions: int | None) -> list[int]:
    counts = list(token_counts)
    if not counts or any(isinstance(t, bool) or not isinstance(t, int) or t <= 0 for t in counts):
        raise ValueError(f"token_counts must be a non-empty list of positive integers, got {token_counts!r}")
    if len(set(counts)) < 3 or any(t % 4 for t in counts):
        raise ValueError(
            "token_counts needs at least 3 different counts, each a multiple of 4 (each runs as 1, 2 "
            f"and 4 sequences, so per-token, per-sequence and attention terms separate), got {token_counts!r}"
        )
    if max_positions is not None and max(counts) > max_positions:
        raise ValueError(f"token_counts: {max(counts)} exceeds the model's max_position_embeddings ({max_positions})")
    return sorted(set(counts))


def profile(
    model: torch.nn.Module,
    token_counts: Sequence[int],
    *,
    skews: Sequence[float] = (0.0, 0.5),
    repeats: int = 3,
    hardware: HardwareSpec | str = "cpu",
    seed: int = 0,
    progress: bool = False,
) -> CostModel:
    """Measure `model` and return the `CostModel` that predicts it (docs/architecture.md).

    Each token count T runs as 1, 2 and 4 sequences of T, T/2, T/4 tokens, so the per-sequence
    terms (attention scores, shared tables, single-sequence views) separate from the per-token
    ones. Under expert parallelism (`bgl.expert_parallel`) every rank of the group calls it at
    once (the forwards exchange tokens), and each shape also runs with `skews` (fractions of
    routed pairs moved to rank 0's experts) so that local routed pairs vary on their own; the
    model is this rank's. Memory is exact per run; times are medians over `repeats` runs.
    """
    adapter = Adapter(model)
    model = adapter.model
    counts = _check_token_counts(token_counts, getattr(adapter.config, "max_position_embeddings", None))
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    group = adapter.expert_group
    if group is not None and len(set(skews)) < 2:
        raise ValueError(f"skews needs at least 2 different fractions under expert parallelism, got {skews!r}")
    hw = preset(hardware) if isinstance(hardware, str) else hardware
    shapes = [(b, t // b) for b in (1, 2, 4) for t in counts]
    runs = [(b, length, s) for b, length in shapes for s in (skews if group is not None else (None,))]
    generator = torch.Generator().manual_seed(seed)
    device = adapter.weight.device
    vocab = adapter.config.vocab_size

    samples: list[dict[int, BlockSample]] = []
    with _instrumented(adapter) as (tracker, monitor):
        for batch, seq_len, skew in tqdm(runs, desc="profiling", disable=not progress):
            ids = torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device)
            with _skewed(adapter, skew):  # in every run, so every run saves the same tensors (its index copy too)
                samples.append(_measure(model, adapter, tracker, monitor, ids, repeats))
    return _fit(samples, adapter, hw)


def _forward(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def _measure(model, adapter: Adapter, tracker: OpTracker, monitor: GateMonitor, ids: torch.Tensor, repeats: int):
    batch, seq_len = ids.shape
    labels = ids.clone()  # their own storage, as data collators make them: the loss's region holds them
    # memory: one pass, recording every saved storage with its savers and its maker
    provenance = _Provenance(tracker)
    ledger = Ledger.for_model(model, current_op=lambda: tracker.current, source=provenance.source)
    # Storages handed to a layer (RoPE tables, masks) or to an op recomputed alone, kept alive for
    # the pass so that no later tensor can take their addresses, and who received them.
    shared: dict[int, torch.Tensor] = {}
    receivers: dict[int, list[int]] = {}  # layers, for the shared storages
    received: dict[int, torch.Tensor] = {}
    takers: dict[int, list[OpId]] = {}  # single ops, for the others

    def layer_arguments(index):
        def hook(_module, args, kwargs):
            for t in shared_arguments(args, kwargs):
                shared[_ptr(t)] = t
                receivers.setdefault(_ptr(t), []).append(index)

        return hook

    def receive(op: OpId, arguments) -> None:
        for t in tree_leaves(arguments):
            if _ptr(t) is not None:
                received[_ptr(t)] = t
                takers.setdefault(_ptr(t), []).append(op)

    weights: dict[OpId, list[weakref.ref]] = {}  # the weights each op saved (for an input's gradient), which the Ledger skips

    def pack(tensor: torch.Tensor):
        packed = ledger.pack(tensor)
        if tracker.current is not None and ledger.excludes(tensor):
            weights.setdefault(tracker.current, []).append(weakref.ref(packed[0]))  # alive while the graph keeps it
        return packed

    final: list[torch.Tensor] = []  # the final norm's output, for the chunked loss's saves
    hooks = [layer.module.register_forward_pre_hook(layer_arguments(layer.index), with_kwargs=True) for layer in adapter.layers]
    hooks.append(adapter.decoder.norm.register_forward_hook(lambda _m, _a, out: final.append(out)))
    # the loss runner hands the labels to the loss's region, which holds them
    hooks.append(model.register_forward_pre_hook(lambda *_: receive(OpId(adapter.head_index, "loss"), labels)))
    for op, module in _alone(adapter):
        if module is None:  # an expert op: its arguments pass through the experts' runner
            setattr(adapter.layers[op.layer].experts, RUNNER_ATTR, _receiving(op.layer, receive))
        else:
            hooks.append(module.register_forward_pre_hook(lambda _m, args, kwargs, op=op: receive(op, (args, kwargs)), with_kwargs=True))
    try:
        with ledger.track(), torch.autograd.graph.saved_tensors_hooks(pack, ledger.unpack), provenance:
            loss = _forward(model, ids, labels)
        records = ledger.records()
        weighted = [op for op, saves in weights.items() if any(ref() is not None for ref in saves)]
        routed = monitor.local_pairs()
        chunked = _chunked_loss_saves(adapter, final[0].detach(), labels)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
        for layer in adapter.layers:
            if layer.moe:
                delattr(layer.experts, RUNNER_ATTR)
    del loss

    # time: forward by op scopes, backward by autograd nodes; medians over repeats
    forward: list[dict[OpId, float]] = []
    backward: list[dict[OpId, float]] = []
    order: list[OpId] = []
    for _ in range(repeats):
        clock = _ForwardClock(tracker, _clock(ids.device))
        try:
            loss = _forward(model, ids, labels)
            clock.stop()
        finally:
            tracker.listeners.remove(clock.enter)
        loss.backward()
        del loss
        forward.append(clock.seconds)
        order = clock.order
        seconds: dict[OpId, float] = {}
        with _Provenance(tracker, seconds, _clock(ids.device)):
            loss = _forward(model, ids, labels)
        loss.backward()
        del loss
        backward.append(seconds)
    model.zero_grad(set_to_none=True)

    def median(runs: list[dict[OpId, float]], op: OpId) -> float:
        values = sorted(r.get(op, 0.0) for r in runs)
        return values[len(values) // 2]

    def producer(source: OpId | None, layer: int, ptr: int) -> str | None:
        """The op of `layer` that made a storage, or INPUT: the input ids, or made in another
        block. None: made inside the saving op's own call (an output saved as it is made, norm
        statistics), before the Provenance saw it."""
        if ptr == _ptr(ids):
            return INPUT
        return None if source is None else source.name if source.layer == layer else INPUT

    def taken(layer: int, ptr: int) -> tuple[str, ...]:
        return tuple(dict.fromkeys(op.name for op in takers.get(ptr, ()) if op.layer == layer))

    head = adapter.head_index
    tensors: dict[int, list[TensorSample]] = {head: chunked}
    for r in records:
        op, ptr = r.op, r.key[1]
        savers = tuple(dict.fromkeys(s.name for s in r.savers if s.layer == op.layer))
        tensors.setdefault(op.layer, []).append(
            TensorSample(
                producer(r.source, op.layer, ptr) or op.name, savers, r.dtype.itemsize, r.dtype.is_floating_point,
                r.nbytes, ptr in shared, receivers=taken(op.layer, ptr),
                chunked=False if op.layer == head and set(savers) & set(LOSS_OPS) else None,
            )
        )
    saving = {s for r in records for s in r.savers}
    for op in weighted:  # an op that saved weights only: no bytes, but a save that keeps a recompute region alive
        if op not in saving:
            tensors.setdefault(op.layer, []).append(TensorSample(op.name, (op.name,), 1, True, 0))
    saved = {r.key[1] for r in records}
    for ptr, tensor in shared.items():  # arguments nothing saves: held only by recompute regions
        if ptr not in saved:
            layers = tuple(i for i in dict.fromkeys(receivers[ptr]) if i != adapter.head_index)
            t = TensorSample(
                INPUT, (), tensor.dtype.itemsize, tensor.dtype.is_floating_point, tensor.untyped_storage().nbytes(),
                held_by=layers,
            )
            tensors.setdefault(-1, []).append(t)
    for ptr, tensor in received.items():  # arguments nothing saves: held only by recompute regions
        if ptr not in saved and ptr not in shared:
            for layer in dict.fromkeys(op.layer for op in takers[ptr]):
                t = TensorSample(
                    producer(provenance.source(tensor), layer, ptr) or INPUT, (), tensor.dtype.itemsize,
                    tensor.dtype.is_floating_point, tensor.untyped_storage().nbytes(), receivers=taken(layer, ptr),
                )
                tensors.setdefault(layer, []).append(t)

    blocks: dict[int, BlockSample] = {}
    for index in dict.fromkeys(op.layer for op in order):
        ops = tuple(op.name for op in order if op.layer == index)
        tokens = batch * seq_len
        single = batch == 1
        load = Load(tokens, routed.get(index, 0), tokens * seq_len, seq_len, batch, float(single), tokens * single)
        blocks[index] = BlockSample(
            block_kind(adapter, index)[0],
            load,
            ops,
            tuple(tensors.get(index, ())),
            {name: median(forward, OpId(index, name)) for name in ops},
            {name: median(backward, OpId(index, name)) for name in ops},
        )
    return blocks


def _chunked_loss_saves(adapter: Adapter, hidden: torch.Tensor, labels: torch.Tensor) -> list[TensorSample]:
    """What the chunked loss (`MitigationOptions.loss_chunk_tokens`) saves instead of the LM head
    and HF's loss, as the loss runner runs it in the loss's scope: the final norm's output, the
    targets, one log-sum-exp per token and the divisor, whatever the chunk size."""
    ledger = Ledger.for_model(adapter.model, current_op=lambda: OpId(adapter.head_index, "loss"))
    with ledger.track():
        loss = chunked_causal_lm_loss(hidden, adapter.model.lm_head, labels, hidden.shape[1])
        records = ledger.records()
    del loss
    return [
        TensorSample(
            INPUT if r.key[1] == _ptr(hidden) else "loss", ("loss",), r.dtype.itemsize, r.dtype.is_floating_point, r.nbytes,
            chunked=True,
        )
        for r in records
    ]


def _alone(adapter: Adapter) -> list[tuple[OpId, torch.nn.Module | None]]:
    """The ops that are recompute units of their own, and the first op of each span a module
    replays, each with the module whose forward its checkpoint region replays (None: an expert
    op, which the experts' runner replays). Such a region holds every tensor that forward
    receives, whether or not any op saves it (a frozen linear under LoRA saves no input)."""
    blocks = [-1, *(layer.index for layer in adapter.layers), adapter.head_index]
    alone = [(OpId(b, u[0]), unit_module(adapter, b, u)) for b in blocks for u in block_units(adapter, b) if len(u) == 1]
    spans = [(OpId(b, s[0]), unit_module(adapter, b, s)) for b in blocks for s in block_spans(adapter, b)]
    return alone + [(op, module) for op, module in spans if module is not None]


def _receiving(layer: int, receive):
    """An experts' runner that reports each expert op's arguments before running it."""

    def run(unit, op, experts, *args, **kwargs):
        if len(unit) == 1:
            receive(OpId(layer, unit[0]), (args, kwargs))
        return op(experts, *args, **kwargs)

    return run


def _params(adapter: Adapter, frozen: bool = False) -> dict[int, tuple[int, int]]:
    """(dense, expert) parameters per block; `frozen`: those that do not train."""
    count = lambda m: sum(p.numel() for p in m.parameters() if not frozen or not p.requires_grad)  # noqa: E731
    out = {-1: (count(adapter.decoder.embed_tokens), 0)}
    for layer in adapter.layers:
        expert = count(layer.wrapped or layer.experts) + count(layer.router) if layer.moe else 0
        out[layer.index] = (count(layer.module) - expert, expert)
    out[adapter.head_index] = (count(adapter.decoder.norm) + count(adapter.model.lm_head), 0)
    return out


def _fit(samples: list[dict[int, BlockSample]], adapter: Adapter, hw: HardwareSpec) -> CostModel:
    """One graph per block. Balanced routing puts T * top_k pairs on a rank's experts, also under
    expert parallelism (each of ep ranks sends it 1/ep of its T * top_k)."""
    params, frozen = _params(adapter), _params(adapter, frozen=True)
    shared_alone = adapter.family.shared_expert_alone
    blocks = {}
    for index, first in samples[0].items():
        units = standard_units(first.kind, first.ops, shared_alone)
        spans = standard_spans(first.kind, first.ops)
        runs = [s[index] for s in samples]
        blocks[index] = fit_block(runs, adapter.expert_group is not None, *params[index], units, spans, frozen[index])
    return CostModel(blocks, hw, adapter.top_k, name=adapter.family.model_type, source="profiled")


def measure_micro_batch(
    model: torch.nn.Module, input_ids: torch.Tensor, *, skew: float | None = None, repeats: int = 3
) -> tuple[int, dict[int, int], float]:
    """What one forward/backward micro-batch really costs, set up as `profile` runs the model:
    (saved bytes at the end of forward, local routed pairs per MoE layer, median wall seconds of
    forward + backward). `skew`: a `RoutingSkew` fraction towards rank 0 (expert parallelism only;
    every rank calls it at once)."""
    adapter = Adapter(model)
    model = adapter.model
    if skew is not None and adapter.expert_group is None:
        raise ValueError("skew needs an expert-parallel model (bgl.expert_parallel)")
    with ExitStack() as stack:
        _, monitor = stack.enter_context(_instrumented(adapter))
        stack.enter_context(_skewed(adapter, skew))
        ledger = Ledger.for_model(model)
        labels = input_ids.clone()
        with ledger.track():
            loss = _forward(model, input_ids, labels)
        saved, routed = ledger.live_device_bytes, monitor.local_pairs()
        loss.backward()
        del loss
        seconds = []
        now = _clock(input_ids.device)
        for _ in range(repeats):
            start = now()
            _forward(model, input_ids, labels).backward()
            seconds.append(now() - start)
        model.zero_grad(set_to_none=True)
    return saved, routed, sorted(seconds)[len(seconds) // 2] if seconds else 0.0
