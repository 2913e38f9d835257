"""Expert parallelism over a torch.distributed process group (paper §II-B; docs/architecture.md).

`expert_parallel(model, group)` shards the routed experts of every MoE layer: rank r of an
ep-rank group keeps experts [r*E/ep, (r+1)*E/ep) of each fused expert parameter and frees the
rest. Attention, routers, shared experts and dense layers stay replicated. Each rank then runs
its own tokens (EP inside data parallelism); an expert-parallel MoE layer is three steps:

- dispatch: the per-expert counts go to the ranks hosting those experts (one `all_to_all_single`
  and the layer's one host sync, where the gate fires with the pairs this rank's experts really
  received), then the routed rows and their routing weights, in the sender's expert-sorted order
  (uneven `all_to_all_single`);
- expert_fc1, expert_act, expert_fc2: the local computation of the "bagualu" experts, unchanged,
  on the received rows (one pair per row, local expert ids);
- combine: the weighted rows go back (the reverse all-to-all), are put back in (token, slot)
  order and summed over the top-k slots.

A local expert's gradient then sums the contributions of every rank's tokens routed to it; every
other gradient is the rank's own.

dispatch and combine keep nothing of their own for backward: they keep the router's top-k index
(the very storage the router keeps) and sort it again in backward to rebuild the permutation,
so under expert parallelism every saved byte still belongs to the model's operators
(docs/architecture.md), and the experts' bytes grow with the pairs this rank received. Their collectives run
in every rank's forward and backward in the same order. A recompute one rank chooses alone never
holds them: the routed experts' recompute unit is the local computation between them
(`costmodel.graph.COMM_OPS`), so plans may differ per rank. Dispatch, the experts and combine
together (`exchange`) are the collective unit (`costmodel.graph.collective_unit`): a region that
every rank runs in the same micro-batch (a static plan, or the gates' agreed escalation, `any_rank`),
whose replay runs the rows' all-to-alls again on every rank; the counts are exchanged once.

Exactness against one process running the full model on the rank's batch: the forward and every
non-expert gradient are computed by the same torch ops on the same rows (the sort, the gathers,
the scatter-adds, the sum over slots), each expert's rows in a fixed order (by source rank, then
as the sender sorted them). Over a group of one that is bitwise. Over more ranks an expert
multiplies every rank's rows at once, and CPU matmul rounds a row differently depending on how
many rows it multiplies, so results agree to the last bits only (tests/test_expert_parallel.py
states the tolerance and measures it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..adapters.adapter import GATE_ATTR, Adapter
from ..adapters.experts import GROUP_ATTR, IMPLEMENTATION, local_expert_range, local_experts, require_plain_weights, run_unit
from ..adapters.gate import tokens_per_expert
from ..adapters.scopes import enter_expert_op
from ..costmodel.graph import COLLECTIVE_OPS


@dataclass(frozen=True)
class ExpertGroup:
    """The expert-parallel group an experts module belongs to, and its share of the experts."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    num_experts: int  # E, over the whole group
    local: range  # the experts this rank hosts

    def forward(self, experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The expert-parallel MoE experts: the counts exchanged (the gate), then dispatch, the local
        experts and combine, the collective unit, through the experts' runner."""
        enter_expert_op(experts, "dispatch")
        route = self.route(experts, top_k_index)
        return run_unit(experts, COLLECTIVE_OPS, partial(self.exchange, route=route), hidden_states, top_k_index, top_k_weights)

    def exchange(self, experts: nn.Module, hidden_states, top_k_index, top_k_weights, *, route: _Route) -> torch.Tensor:
        """Dispatch, the local experts, combine, for the counts `route` exchanged: what a region of
        the collective unit replays (the same all-to-alls on every rank)."""
        rows, weights = _Dispatch.apply(hidden_states, top_k_weights, top_k_index, route)
        local_ids = torch.repeat_interleave(
            torch.arange(len(self.local), device=rows.device).repeat(self.size),
            torch.tensor(route.received, device=rows.device),
            output_size=rows.size(0),
        )
        # a stable sort keeps each expert's rows in arrival order: by source rank, then as each
        # sender sorted them (with one rank, exactly the one-process order: bitwise)
        out = local_experts(experts, rows, local_ids.unsqueeze(1), weights.unsqueeze(1), None, stable=True)
        enter_expert_op(experts, "combine")
        return _Combine.apply(out, top_k_index, route).to(hidden_states.dtype)

    def route(self, experts: nn.Module, top_k_index: torch.Tensor) -> _Route:
        """Exchange the per-expert counts; the gate fires with what this rank received."""
        counts = tokens_per_expert(top_k_index, self.num_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # (source, local expert), source-major
        per_source = received.view(self.size, len(self.local))
        gate = getattr(experts, GATE_ATTR, None)
        if gate is not None:
            gate(per_source.sum(0), per_source.sum())
        sent, got, flat = (t.tolist() for t in (counts.view(self.size, -1).sum(1), per_source.sum(1), received))
        if sum(sent) != top_k_index.numel():
            raise ValueError(f"top_k_index holds expert ids outside [0, {self.num_experts})")
        return _Route(self.group, sent, got, flat)


@dataclass(frozen=True)
class _Route:
    """One micro-batch's splits through one layer: rows sent to each rank, received from each
    rank, and received per (source, local expert). Host integers, so nothing here is saved."""

    group: dist.ProcessGroup | None
    sent: list[int]
    got: list[int]
    received: list[int]


@dataclass
class Waits:
    """The all-to-alls issued inside `beside`, and the seconds spent waiting on them once the work
    beside them had run (host time: on CUDA a wait is a stream dependency and costs the host nothing)."""

    exchanges: int = 0
    waited_s: float = 0.0


_beside = threading.local()  # (work, waits) while inside `beside` on this thread


@contextmanager
def beside(work: Callable[[], object] | None, waits: Waits) -> Iterator[None]:
    """Inside, every all-to-all this thread issues (dispatch's, combine's) runs `work()` while it is
    in flight, then waits, counted in `waits`; with `work` None it only waits and counts. The fused
    executor puts the other micro-batch's backward there (paper §V-B). All-to-alls that `work`
    issues itself wait at once: the work beside an exchange is never nested."""
    before = getattr(_beside, "state", None)
    _beside.state = (work, waits)
    try:
        yield
    finally:
        _beside.state = before


def _all_to_all(group, *exchanges: tuple[torch.Tensor, list[int], list[int]]) -> list[torch.Tensor]:
    """Each (rows, out_splits, in_splits) exchanged over `group`, every one issued before any is
    waited on: the rows and their routing weights travel side by side (gloo's worker threads, or
    NCCL's stream), not one after the other, and inside `beside` the work given there runs while
    they travel. Every rank issues them in the same order."""
    outs, works = [], []
    for rows, out_splits, in_splits in exchanges:
        outs.append(rows.new_empty((sum(out_splits), *rows.shape[1:])))
        works.append(dist.all_to_all_single(outs[-1], rows.contiguous(), out_splits, in_splits, group=group, async_op=True))
    work, waits = getattr(_beside, "state", None) or (None, None)
    if work is not None:
        _beside.state = None  # the work's own all-to-alls wait at once
        try:
            work()
        finally:
            _beside.state = (work, waits)
    start = time.perf_counter()
    for handle in works:
        handle.wait()
    if waits is not None:
        waits.exchanges += 1
        waits.waited_s += time.perf_counter() - start
    return outs


def _sorted_pairs(top_k_index: torch.Tensor) -> torch.Tensor:
    """Flat (token, slot) indices in expert order: the one-process forward's sort (expert_fc1)."""
    return torch.sort(top_k_index.reshape(-1))[1]


class _Dispatch(torch.autograd.Function):
    """Rows and routing weights of this rank's pairs, sent to the ranks hosting their experts."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, top_k_index, route: _Route):
        perm = _sorted_pairs(top_k_index)
        k = top_k_index.size(-1)
        rows, weights = _all_to_all(
            route.group, (hidden_states[perm // k], route.got, route.sent), (top_k_weights.reshape(-1)[perm], route.got, route.sent)
        )
        ctx.save_for_backward(top_k_index)
        ctx.route, ctx.tokens_shape, ctx.weights_shape = route, hidden_states.shape, top_k_weights.shape
        return rows, weights

    @staticmethod
    def backward(ctx, grad_rows, grad_weights):
        (top_k_index,) = ctx.saved_tensors
        route, perm = ctx.route, _sorted_pairs(top_k_index)
        k = top_k_index.size(-1)
        grad_rows, grad_weights = _all_to_all(route.group, (grad_rows, route.sent, route.got), (grad_weights, route.sent, route.got))
        # the scatter-adds autograd makes for the one-process gathers hidden[perm // k], weights[perm]
        grad_hidden = grad_rows.new_zeros(ctx.tokens_shape).index_put_((perm // k,), grad_rows, accumulate=True)
        grad_w = grad_weights.new_zeros(ctx.weights_shape).view(-1).index_put_((perm,), grad_weights, accumulate=True)
        return grad_hidden, grad_w.view(ctx.weights_shape), None, None


class _Combine(torch.autograd.Function):
    """The experts' weighted rows back to their senders, in (token, slot) order, summed over slots."""

    @staticmethod
    def forward(ctx, out, top_k_index, route: _Route):
        (back,) = _all_to_all(route.group, (out, route.sent, route.got))
        perm = _sorted_pairs(top_k_index)
        pairs = back.new_empty(back.shape).index_put_((perm,), back)
        ctx.save_for_backward(top_k_index)
        ctx.route = route
        return pairs.view(*top_k_index.shape, back.size(-1)).sum(dim=1)

    @staticmethod
    def backward(ctx, grad):
        (top_k_index,) = ctx.saved_tensors
        route, perm = ctx.route, _sorted_pairs(top_k_index)
        # each pair's gradient is its token's (the sum's backward): one gather by token
        (grad_out,) = _all_to_all(route.group, (grad[perm // top_k_index.size(-1)], route.got, route.sent))
        return grad_out, None, None


def any_rank(asks: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether any rank of `group` asks (one all-reduce of one integer on `device`, which the
    process group's backend serves): the gates' agreement on an escalation (the collective one
    over an expert group; any, in lockstep: `parallel.lockstep`). Every rank calls it at the same
    gates in the same order."""
    flag = torch.tensor([int(asks)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def expert_group(experts: nn.Module) -> ExpertGroup | None:
    """The group an experts module is sharded over; None when it hosts every expert."""
    return getattr(experts, GROUP_ATTR, None)


def expert_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> range:
    """`bgl.expert_parallel`: shard every MoE layer's routed experts over `group` (default: the
    world) and switch the layers to dispatch / combine. Returns this rank's expert range.

    Each fused expert parameter (leading dimension E) keeps the rows of the local experts; the
    others' storage is freed (a meta-device model stays on meta, for a sharded load). The model
    must run the "bagualu" experts implementation and E must be divisible by the group size."""
    adapter = Adapter(model)
    require_plain_weights(adapter.config)
    if adapter.config._experts_implementation != IMPLEMENTATION:
        raise ValueError(
            f"expert_parallel needs the {IMPLEMENTATION!r} experts implementation, the model runs "
            f"{adapter.config._experts_implementation!r}: load it with experts_implementation={IMPLEMENTATION!r} "
            f"or call model.set_experts_implementation({IMPLEMENTATION!r}) after `import bagualu_plugin`"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert_parallel needs an initialised torch.distributed process group (init_process_group)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    num_experts = adapter.num_experts
    if num_experts % size:
        raise ValueError(f"the expert-parallel group has {size} ranks, which does not divide num_experts={num_experts}")
    local = local_expert_range(num_experts, size, rank)
    for layer in adapter.layers:
        if not layer.moe:
            continue
        experts = layer.experts
        if getattr(experts, GROUP_ATTR, None) is not None:
            raise ValueError(f"layer {layer.index}: the experts are expert-parallel already")
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.dim() and param.size(0) == num_experts:
                shard = nn.Parameter(param.data[local.start : local.stop].clone(), requires_grad=param.requires_grad)
                setattr(experts, name, shard)
        experts.num_experts = len(local)
        setattr(experts, GROUP_ATTR, ExpertGroup(group, size, rank, num_experts, local))
    return local
