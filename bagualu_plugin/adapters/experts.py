"""The "bagualu" experts implementation: transformers' `grouped_mm` experts forward, taken apart
into the three operators of docs/architecture.md so that each can be mitigated on its own
(recompute, offload, FP8 per op):

    expert_fc1  sort the (token, expert) pairs by expert, gather their tokens, up / gate_up
                grouped linear (+ bias), sentinel masking
    expert_act  `experts._apply_gate` (gated experts) or `experts.act_fn`
    expert_fc2  down grouped linear (+ bias), optional post-expert norm, routing-weight multiply,
                inverse permutation, per-token sum, cast back

Each op is a plain function `op(experts, *tensors) -> tensors` with no state kept between them
except what is passed, so a runtime can wrap any one of them in a checkpoint or saved-tensor hooks.
`expert_op_runner` (an attribute set on an experts module) is that seam: when present the forward
calls `runner(unit, op, experts, *args, **kwargs)` instead of `op(experts, *args, **kwargs)`, once
for the three ops together (unit `EXPERT_OPS`, the routed experts' recompute unit) and once per op
inside (unit `(name,)`).

The ops are the same torch ops, in the same order, as `grouped_mm_experts_forward`, so loss and
every gradient are bitwise equal to the default implementation on CPU (tests/test_adapters.py).

Under expert parallelism (`parallel.expert`) the three ops run between dispatch and combine, on
the rows this rank's experts received, as one pair of top-k 1 each. Experts loaded in FP8 dispatch
through transformers' FP8 experts interface instead, where "bagualu" is the refusal to run them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..costmodel.graph import EXPERT_OPS
from .adapter import GROUP_ATTR
from .scopes import enter_expert_op

try:
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    from transformers.integrations.moe import ExpertsInterface, _grouped_linear
except ImportError as error:  # _grouped_linear: private helper of transformers' MoE integration
    raise ImportError(
        "bagualu_plugin's experts implementation needs transformers.integrations.moe.ExpertsInterface and "
        "_grouped_linear, and transformers.integrations.finegrained_fp8.FP8ExpertsInterface (transformers>=5.17,<5.27); "
        "the installed transformers does not provide them"
    ) from error

IMPLEMENTATION = "bagualu"  # the name given to from_pretrained(experts_implementation=...)
RUNNER_ATTR = "expert_op_runner"  # on an experts module: optional runner(unit, op, experts, *args, **kw)


def _quantized_weights(method) -> ValueError:
    return ValueError(
        f"the checkpoint is quantized (quantization_config.quant_method={str(method)!r}) and the {IMPLEMENTATION!r} "
        "experts run on plain weights: load it dequantized, e.g. from_pretrained(path, "
        "quantization_config=FineGrainedFP8Config(dequantize=True)) for FP8"
    )


def require_plain_weights(config) -> None:
    """The "bagualu" experts run on plain weights: refuse a model loaded quantized (DeepSeek-V3
    ships FP8 experts) before a runtime is installed, with the way to load it."""
    q = getattr(config, "quantization_config", None)
    get = q.get if isinstance(q, dict) else lambda name, default=None: getattr(q, name, default)
    method = None if q is None else get("quant_method")
    if method is not None and not get("dequantize", False):
        raise _quantized_weights(method)


# --- the three operators -----------------------------------------------------------------------


def expert_fc1(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, *, stable: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Up (or gate_up) projection of the routed pairs, grouped by expert. Returns (proj_out (S, 2I
    or I), expert_ids_g (S,) sorted expert ids, perm (S,) flat pair index of each row, offsets (E,)
    int32 group ends). `stable`: keep the rows' order within an expert (expert parallelism: the
    order they arrived in); the default is grouped_mm_experts_forward's sort, which is not stable
    beyond 16 elements on CPU."""
    num_top_k = top_k_index.size(-1)
    num_experts = experts.num_experts
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1), stable=stable)
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
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Down projection, routing weights, back to token order, sum over the top-k slots. Returns
    (T, H) in `dtype` (the hidden states' dtype; default: the dtype of the weighted sum)."""
    num_tokens, num_top_k = top_k_weights.shape
    weighted_out = _down_weighted(experts, act_out, expert_ids_g, perm, offsets, top_k_weights)
    # Restore original order (exactly as grouped_mm_experts_forward).
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted_out = weighted_out[inv_perm]
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
    if getattr(experts, "has_post_expert_norm", False):  # transformers 5.2x
        proj_out = experts.post_expert_norm(proj_out)
    return proj_out * sample_weights_g.unsqueeze(-1)


def sharded(experts: nn.Module) -> bool:
    """Whether transformers' own expert parallelism shards `experts` (the pairs routed to other
    ranks then come as sentinel ids): the experts' mark where the release sets one (5.2x), else the
    model's `distributed_config.enable_expert_parallel`, which older 5.x releases read instead."""
    marked = getattr(experts, "_is_expert_parallel", None)
    if marked is not None:
        return marked
    distributed = getattr(getattr(experts, "config", None), "distributed_config", None)
    return bool(getattr(distributed, "enable_expert_parallel", False))


def _sentinel_mask(experts: nn.Module, expert_ids_g: torch.Tensor) -> torch.Tensor | None:
    if not sharded(experts):
        return None
    return (expert_ids_g >= experts.num_experts).unsqueeze(-1)


def _in_bounds(experts: nn.Module, expert_ids_g: torch.Tensor) -> torch.Tensor:
    """Expert ids usable for a bias gather: sentinels clamped (their rows are masked anyway)."""
    if not sharded(experts):
        return expert_ids_g
    return expert_ids_g.clamp(max=experts.num_experts - 1)


OPS = {"expert_fc1": expert_fc1, "expert_act": expert_act, "expert_fc2": expert_fc2}


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextmanager
def adapted_weights(wrapped: nn.Module | None) -> Iterator[None]:
    """PEFT's LoRA on the fused expert weights (`LoraConfig(target_parameters=...)`) in force,
    as its `ParamWrapper`s' forward puts it: W + scale B A in place of each wrapped weight, made
    at its first read. A recompute region of expert ops replays after that forward has ended and
    would read W alone: each wrapper not in force is activated for the replay. Registering the
    parametrization evaluates it once, a graph nobody keeps: its saves bypass the replay's."""
    with ExitStack() as stack:
        while wrapped is not None and hasattr(wrapped, "parameter_name"):
            active = not wrapped.disable_adapters and not wrapped.merged
            if active and not parametrize.is_parametrized(wrapped.get_base_layer(), wrapped.parameter_name):
                with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    stack.enter_context(wrapped._activate_lora(wrapped.active_adapters))
            wrapped = wrapped.base_layer
        yield


def run_unit(experts: nn.Module, unit: tuple[str, ...], op, *args, **kwargs):
    """`op(experts, *args, **kwargs)`, through the module's runner when one is set (which may
    run it as the recompute region of `unit`)."""
    runner = getattr(experts, RUNNER_ATTR, None)
    if runner is None:
        return op(experts, *args, **kwargs)
    return runner(unit, op, experts, *args, **kwargs)


def _run(experts: nn.Module, name: str, *args, **kwargs):
    enter_expert_op(experts, name)
    return run_unit(experts, (name,), OPS[name], *args, **kwargs)


def _local(experts: nn.Module, hidden_states, top_k_index, top_k_weights, dtype, stable):
    proj_out, expert_ids_g, perm, offsets = _run(experts, "expert_fc1", hidden_states, top_k_index, stable=stable)
    act_out = _run(experts, "expert_act", proj_out)
    return _run(experts, "expert_fc2", act_out, expert_ids_g, perm, offsets, top_k_weights, dtype=dtype)


def local_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    dtype: torch.dtype | None,
    stable: bool = False,
) -> torch.Tensor:
    """expert_fc1, expert_act, expert_fc2 on the rows this module's experts receive: the routed
    experts' recompute unit (`costmodel.graph.EXPERT_OPS`), run as one through the runner."""
    return run_unit(experts, EXPERT_OPS, _local, hidden_states, top_k_index, top_k_weights, dtype, stable)


# --- expert parallelism ------------------------------------------------------------------------


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


# --- the registered forward ------------------------------------------------------------------


def bagualu_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for `grouped_mm_experts_forward`, as three ops (expert_fc1, expert_act, expert_fc2);
    under expert parallelism (`parallel.expert`) between dispatch and combine."""
    group = getattr(self, GROUP_ATTR, None)
    if group is not None:
        return group.forward(self, hidden_states, top_k_index, top_k_weights)
    return local_experts(self, hidden_states, top_k_index, top_k_weights, hidden_states.dtype)


def fp8_experts_forward(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """The "bagualu" entry of transformers' FP8 experts interface, through which the experts of a
    checkpoint loaded in FP8 dispatch (a KeyError there otherwise, with or without our runtime):
    the refusal of `require_plain_weights`, at their first forward."""
    raise _quantized_weights("fp8")


ExpertsInterface.register(IMPLEMENTATION, bagualu_experts_forward)
FP8ExpertsInterface.register(IMPLEMENTATION, fp8_experts_forward)
