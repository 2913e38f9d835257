"""The "bagualu" experts implementation: transformers' `grouped_mm` experts forward, taken apart
into the three operators of DESIGN.md section 4 so that each can be mitigated on its own
(recompute, offload, FP8 per op):

    expert_fc1  sort the (token, expert) pairs by expert, gather their tokens, up / gate_up
                grouped linear (+ bias), sentinel masking
    expert_act  `experts._apply_gate` (gated experts) or `experts.act_fn`
    expert_fc2  down grouped linear (+ bias), optional post-expert norm, routing-weight multiply,
                inverse permutation, per-token sum, cast back

Each op is a plain function `op(experts, *tensors) -> tensors` with no state kept between them
except what is passed, so a runtime can wrap any one of them in a checkpoint or saved-tensor hooks.
`expert_op_runner` (an attribute set on an experts module) is that seam: when present the forward
calls `runner(name, op, experts, *args, **kwargs)` instead of `op(experts, *args, **kwargs)`.

The ops are the same torch ops, in the same order, as `grouped_mm_experts_forward`, so loss and
every gradient are bitwise equal to the default implementation on CPU (tests/test_adapters.py).

Expert parallelism is emulated (DESIGN.md section 6b): `set_expert_parallel(model, ep_size,
ep_rank)` marks experts [ep_rank*E/ep, (ep_rank+1)*E/ep) as hosted on this rank. The pairs routed
to them run through fc1 / act / fc2 and keep their activations; the pairs routed to the other
(remote) experts still run here, so loss and gradients stay exact, but under a non-reentrant
`torch.utils.checkpoint` whose inputs are the experts' own inputs, so nothing per remote pair is
held for backward (the checkpoint keeps references to those inputs, which exist anyway: the
routing rows, 12 bytes per (token, slot) in fp32, are all it adds). The saved bytes of the experts
then grow with the local routed pairs only, as on a real EP rank. It is an emulation: no
all-to-all, and every rank's compute runs here, so it costs the remote pairs' forward twice.

Exactness of the emulation against ep_size=1: bitwise for top_k <= 2 (loss and every gradient,
all six tiny families, fp32 and bf16). Both halves reuse the one-pass sort (`split_pairs`), so each
expert sees the same rows in the same order, and the local half writes its rows into the remote
half's output instead of adding, so the forward is bitwise for any top_k. The one sum that changes
order is a token's gradient w.r.t. the experts' input when top_k > 2: its local and remote pair
gradients are summed apart, then together. Measured with top_k 3, 4, 8 and ep_size=4: loss
bitwise, gradients within a relative norm error of 6e-7 in fp32 and 1.4e-2 in bf16 (bf16
rounding of that one sum, carried into the earlier layers).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..costmodel.graph import EXPERT_OPS
from .adapter import GROUP_ATTR
from .scopes import enter_expert_op

try:
    from transformers.integrations.moe import ExpertsInterface, _grouped_linear
except ImportError as error:  # private helper of transformers' MoE integration
    raise ImportError(
        "bagualu_plugin's experts implementation needs transformers.integrations.moe.ExpertsInterface and "
        "_grouped_linear (transformers>=5.23,<6); the installed transformers does not provide them"
    ) from error

IMPLEMENTATION = "bagualu"  # the name given to from_pretrained(experts_implementation=...)
EP_ATTR = "_bagualu_local_experts"  # on an experts module: (lo, hi) of the experts hosted locally (emulation)
RUNNER_ATTR = "expert_op_runner"  # on an experts module: optional runner(unit, op, experts, *args, **kw)


# --- the three operators -----------------------------------------------------------------------


def expert_fc1(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, pairs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Up (or gate_up) projection of the routed pairs, grouped by expert.

    pairs: None for every (token, slot) pair, else the flat indices (into `top_k_index.reshape(-1)`)
    of the pairs to compute, already grouped by expert (`split_pairs`). Returns (proj_out (S', 2I
    or I), expert_ids_g (S',) sorted expert ids, perm (S',) flat pair index of each row, offsets
    (E,) int32 group ends)."""
    num_top_k = top_k_index.size(-1)
    num_experts = experts.num_experts
    expert_ids = top_k_index.reshape(-1)
    if pairs is None:
        expert_ids_g, perm = torch.sort(expert_ids)
    else:
        expert_ids_g, perm = expert_ids[pairs], pairs
    selected_hidden_states_g = hidden_states[perm // num_top_k]

    # histc, as grouped_mm_experts_forward: float input on CPU/MPS, int elsewhere; ids >= E dropped.
    device = hidden_states.device
    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)

    # transformers' own expert parallelism marks pairs of other ranks with ids >= E (sentinels):
    # the sort pushes them to the tail, past offsets[-1], where grouped_mm leaves rows uninitialised.
    sentinel_mask = _sentinel_mask(experts, expert_ids_g)
    if experts.has_gate:
        weight, bias = experts.gate_up_proj, getattr(experts, "gate_up_proj_bias", None)
    else:
        weight, bias = experts.up_proj, getattr(experts, "up_proj_bias", None)
    bias = bias[_in_bounds(experts, expert_ids_g)] if experts.has_bias else None
    if sentinel_mask is not None:
        selected_hidden_states_g.masked_fill_(sentinel_mask, 0.0)  # zeroes the backward's sentinel rows
    proj_out = _grouped_linear(
        selected_hidden_states_g, weight, offsets, bias=bias, is_transposed=experts.is_transposed
    )
    if sentinel_mask is not None:
        proj_out = proj_out.masked_fill(sentinel_mask, 0.0)
    return proj_out, expert_ids_g, perm, offsets


def expert_act(experts: nn.Module, proj_out: torch.Tensor) -> torch.Tensor:
    """The gate (`experts._apply_gate`, e.g. SiLU(gate) * up, or gpt-oss's clamped SwiGLU on
    interleaved columns) for gated experts, else the activation function."""
    if experts.has_gate:
        return experts._apply_gate(proj_out)
    return experts.act_fn(proj_out)


def expert_fc2(
    experts: nn.Module,
    act_out: torch.Tensor,
    expert_ids_g: torch.Tensor,
    perm: torch.Tensor,
    offsets: torch.Tensor,
    top_k_weights: torch.Tensor,
    others: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Down projection, routing weights, back to token order, sum over the top-k slots.

    others: (S, H) contributions of the pairs not in `perm` (zero on the rows of `perm`), from
    `remote_pairs`; None when `perm` holds every pair. Returns (T, H) in `dtype` (the hidden
    states' dtype; default: the dtype of the weighted sum)."""
    num_tokens, num_top_k = top_k_weights.shape
    weighted_out = _down_weighted(experts, act_out, expert_ids_g, perm, offsets, top_k_weights)
    num_pairs = num_tokens * num_top_k
    if others is None and perm.numel() == num_pairs:
        # Restore original order (exactly as grouped_mm_experts_forward).
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
        weighted_out = weighted_out[inv_perm]
    else:
        # Some pairs are computed elsewhere: write ours into their rows. No addition happens, so
        # the per-pair values, and the per-token sum below, are those of the one-pass forward.
        if others is None:
            others = weighted_out.new_zeros(num_pairs, weighted_out.size(-1))
        weighted_out = others.index_put((perm,), weighted_out)
    final_hidden_states = weighted_out.view(num_tokens, num_top_k, weighted_out.size(-1)).sum(dim=1)
    return final_hidden_states if dtype is None else final_hidden_states.to(dtype)


def _down_weighted(experts, act_out, expert_ids_g, perm, offsets, top_k_weights) -> torch.Tensor:
    """(S', H): down projection (+ bias), post-expert norm, times the routing weight, sorted order."""
    sample_weights_g = top_k_weights.reshape(-1)[perm]
    sentinel_mask = _sentinel_mask(experts, expert_ids_g)
    bias = experts.down_proj_bias[_in_bounds(experts, expert_ids_g)] if experts.has_bias else None
    proj_out = _grouped_linear(act_out, experts.down_proj, offsets, bias=bias, is_transposed=experts.is_transposed)
    if sentinel_mask is not None:
        proj_out = proj_out.masked_fill(sentinel_mask, 0.0)
    if experts.has_post_expert_norm:
        proj_out = experts.post_expert_norm(proj_out)
    return proj_out * sample_weights_g.unsqueeze(-1)


def _sentinel_mask(experts: nn.Module, expert_ids_g: torch.Tensor) -> torch.Tensor | None:
    if not experts._is_expert_parallel:
        return None
    return (expert_ids_g >= experts.num_experts).unsqueeze(-1)


def _in_bounds(experts: nn.Module, expert_ids_g: torch.Tensor) -> torch.Tensor:
    """Expert ids usable for a bias gather: sentinels clamped (their rows are masked anyway)."""
    if not experts._is_expert_parallel:
        return expert_ids_g
    return expert_ids_g.clamp(max=experts.num_experts - 1)


OPS = {"expert_fc1": expert_fc1, "expert_act": expert_act, "expert_fc2": expert_fc2}


def _through_runner(experts: nn.Module, unit: tuple[str, ...], op, *args, **kwargs):
    runner = getattr(experts, RUNNER_ATTR, None)
    if runner is None:
        return op(experts, *args, **kwargs)
    return runner(unit, op, experts, *args, **kwargs)


def _run(experts: nn.Module, name: str, *args, **kwargs):
    enter_expert_op(experts, name)
    return _through_runner(experts, (name,), OPS[name], *args, **kwargs)


def _local(experts: nn.Module, hidden_states, top_k_index, top_k_weights, dtype):
    proj_out, expert_ids_g, perm, offsets = _run(experts, "expert_fc1", hidden_states, top_k_index)
    act_out = _run(experts, "expert_act", proj_out)
    return _run(experts, "expert_fc2", act_out, expert_ids_g, perm, offsets, top_k_weights, dtype=dtype)


def local_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """expert_fc1, expert_act, expert_fc2 on the rows this module's experts receive: the routed
    experts' recompute unit (`costmodel.graph.EXPERT_OPS`), run as one through the runner."""
    return _through_runner(experts, EXPERT_OPS, _local, hidden_states, top_k_index, top_k_weights, dtype)


# --- emulated expert parallelism -------------------------------------------------------------


def split_pairs(top_k_index: torch.Tensor, lo: int, hi: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the (token, slot) pairs routed to experts [lo, hi) (local) and to the other
    experts (remote; sentinel ids >= num_experts belong to neither), each grouped by expert.

    Both come out of the same `torch.sort` as the one-pass forward, not a sort of their own: CPU
    `torch.sort` is not stable beyond 16 elements, so the order of an expert's rows depends on the
    whole array, and the weight gradients (sums over an expert's rows) on that order."""
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    local = (expert_ids_g >= lo) & (expert_ids_g < hi)
    remote = ~local & (expert_ids_g >= 0) & (expert_ids_g < num_experts)
    return perm[local], perm[remote]


def remote_pairs(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """(S, H) weighted outputs of the pairs routed to experts not hosted on this rank (zero rows for
    local pairs). Run under checkpoint by the forward, so it is a function of the forward's inputs
    only and keeps nothing per remote pair between forward and backward."""
    lo, hi = getattr(experts, EP_ATTR)
    pairs = split_pairs(top_k_index, lo, hi, experts.num_experts)[1]
    proj_out, expert_ids_g, perm, offsets = expert_fc1(experts, hidden_states, top_k_index, pairs)
    act_out = expert_act(experts, proj_out)
    weighted = _down_weighted(experts, act_out, expert_ids_g, perm, offsets, top_k_weights)
    return weighted.new_zeros(top_k_index.numel(), weighted.size(-1)).index_put((perm,), weighted)


def local_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Experts hosted on rank `ep_rank` of an expert-parallel group of `ep_size` ranks."""
    for name, value in (("num_experts", num_experts), ("ep_size", ep_size), ("ep_rank", ep_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} must be >= 1 and divide num_experts={num_experts}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} must satisfy 0 <= ep_rank < ep_size={ep_size}")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def set_expert_parallel(model_or_adapter, ep_size: int, ep_rank: int) -> range:
    """Emulate rank `ep_rank` of `ep_size` expert-parallel ranks in this process (DESIGN.md 6b):
    every MoE layer's experts keep saved activations only for pairs routed to their local experts
    (`local_expert_range`); the other pairs run under recompute. ep_size=1 turns it off. Acts
    through the "bagualu" experts implementation only. Returns the local expert range."""
    from .adapter import Adapter

    adapter = model_or_adapter if isinstance(model_or_adapter, Adapter) else Adapter(model_or_adapter)
    local = None
    for layer in adapter.layers:
        if not layer.moe:
            continue
        local = local_expert_range(layer.experts.num_experts, ep_size, ep_rank)
        if ep_size == 1:
            if hasattr(layer.experts, EP_ATTR):
                delattr(layer.experts, EP_ATTR)
        else:
            setattr(layer.experts, EP_ATTR, (local.start, local.stop))
    return local


# --- the registered forward ------------------------------------------------------------------


def bagualu_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for `grouped_mm_experts_forward`, as three ops (expert_fc1, expert_act, expert_fc2);
    under expert parallelism (`parallel.expert`) between dispatch and combine."""
    group = getattr(self, GROUP_ATTR, None)
    if group is not None:
        return group.forward(self, hidden_states, top_k_index, top_k_weights)
    if getattr(self, EP_ATTR, None) is None:
        return local_experts(self, hidden_states, top_k_index, top_k_weights, hidden_states.dtype)
    return _through_runner(self, EXPERT_OPS, _emulated, hidden_states, top_k_index, top_k_weights)


def _emulated(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The emulated rank's experts (`set_expert_parallel`), as one recompute unit: the remote pairs
    under their own checkpoint, then the local ones."""
    lo, hi = getattr(self, EP_ATTR)
    # One node where the local and remote gradients of the hidden states meet, so they are summed
    # with each other before anything else is added (as the single gather of the one-pass forward).
    hidden_states = hidden_states.view_as(hidden_states)
    enter_expert_op(self, "expert_fc1")
    if torch.is_grad_enabled():
        others = checkpoint(remote_pairs, self, hidden_states, top_k_index, top_k_weights, use_reentrant=False)
    else:
        others = remote_pairs(self, hidden_states, top_k_index, top_k_weights)
    pairs = split_pairs(top_k_index, lo, hi, self.num_experts)[0]
    proj_out, expert_ids_g, perm, offsets = _run(self, "expert_fc1", hidden_states, top_k_index, pairs)
    act_out = _run(self, "expert_act", proj_out)
    return _run(
        self, "expert_fc2", act_out, expert_ids_g, perm, offsets, top_k_weights, others, dtype=hidden_states.dtype
    )


ExpertsInterface.register(IMPLEMENTATION, bagualu_experts_forward)
