"""Recompute regions (paper §IV-B): a recompute unit's or span's forward run under our checkpoint
(`runtime.replay`). A unit's region drops every save of its ops; a span's region
(`costmodel.graph.standard_spans`) drops only the recomputed ops' saves and sends every other
save through the plan's hooks (`SpanSaves`). The region's inputs are held as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..adapters.experts import IMPLEMENTATION
from .replay import Frame, recording, same, top_hooks


@contextmanager
def bagualu_experts(config) -> Iterator[None]:
    """The "bagualu" experts implementation for the duration of the block: the one a checkpoint
    recorded with, also when it recomputes after `apply_plan` has restored the model's own."""
    previous = config._experts_implementation_internal
    if previous == IMPLEMENTATION:  # a config's validated write costs ~10 us: none where nothing changes
        yield
        return
    config._experts_implementation_internal = IMPLEMENTATION
    try:
        yield
    finally:
        config._experts_implementation_internal = previous


class SpanSaves:
    """Where the saves inside a span's checkpoint go when it recomputes only some of the span's ops
    (`costmodel.graph.standard_spans`): the dropped ops' saves to the checkpoint, which replays the
    span in backward; every other save where it would go without the checkpoint (the plan's
    hooks, so the Ledger counts it and the plan keeps, offloads or quantises it).

    The forward tells the ops apart by the op scope at each save, and the dropped set is read
    live, so a gate that escalates the MoE block's experts mid-forward still drops their saves.
    The replay repeats the forward's decisions in save order: it may run after `apply_plan` has
    removed the op scopes; there the other ops' saves stay with the replay's own graph, which is
    discarded, as detached aliases (a saved output kept as it is would hold its own node through
    the hooks, a cycle Python's collector cannot see, and with it the region). Why not torch's
    selective checkpointing: it caches op outputs outside the saved-tensor hooks, where the Ledger
    would not see them, and every output, saved or not."""

    def __init__(self, dropped: Callable[[], bool]):
        self.dropped = dropped
        self.outside = top_hooks()  # taken before the checkpoint pushes its own
        self.decisions: list[bool] | None = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        checkpoint_pack, checkpoint_unpack = top_hooks()
        if self.decisions is None:
            decisions = self.decisions = []
            pack_outside, unpack_outside = self.outside

            def decide() -> bool:
                decisions.append(self.dropped())
                return decisions[-1]

        else:
            replay = iter(self.decisions)
            pack_outside, unpack_outside = torch.Tensor.detach, same

            def decide() -> bool:
                return next(replay, True)  # more saves than the forward made: the replay check says so

        def pack(tensor: torch.Tensor):
            if decide():
                return True, checkpoint_pack(tensor)
            return False, pack_outside(tensor)

        def unpack(packed):
            dropped, payload = packed
            return checkpoint_unpack(payload) if dropped else unpack_outside(payload)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


@contextmanager
def region(
    module: nn.Module,
    forward: Callable,
    config,
    args: tuple,
    kwargs: dict,
    saves: Callable = nullcontext,
    holding: AbstractContextManager = nullcontext(),
) -> Iterator[Frame]:
    """Inside, `forward(*args, **kwargs)` of `module` runs as a recompute region (the caller runs
    it: a runner, or torch between a module's hooks), its saves routed by `saves()` (a
    `SpanSaves`; by default all are the region's frame's), under our checkpoint: yields the frame.

    Every tensor the forward receives, keyword arguments and tuples (RoPE tables) included, is
    handed to the frame, which saves it for backward through the hooks of `holding` (those in
    force outside, by default), where the Ledger sees it; the replay holds no other reference to them.
    It runs `forward` as the forward did, with the experts the forward ran, even after the
    runtime has been removed.
    """
    if any(kwargs.get(name) is not None for name in ("cache", "past_key_values", "past_key_value")):
        raise ValueError(
            f"{type(module).__name__} is recomputed but received a KV cache, which recomputation would "
            "update twice; train with use_cache=False"
        )
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    inputs = tuple(leaves[i] for i in where)
    for i in where:
        leaves[i] = None

    def run(*tensors):
        filled = list(leaves)
        for i, t in zip(where, tensors):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        with bagualu_experts(config), saves():
            return forward(*a, **kw)

    with ExitStack() as stack:
        stack.enter_context(holding)  # under the frame's hooks: only the frame's saves of the inputs see it
        frame = stack.enter_context(recording(run, inputs))
        stack.enter_context(bagualu_experts(config))
        stack.enter_context(saves())
        yield frame
