"""Which module of an HF model replays which operators: the recompute units and spans of each
block (`costmodel.graph.standard_units`, `standard_spans`) mapped onto the model's modules."""

from __future__ import annotations

from torch import nn

from ..costmodel.graph import ATTENTION_OPS, COLLECTIVE_OPS, EXPERT_OPS, collective_unit, standard_spans, standard_units
from .adapter import Adapter


def unit_module(adapter: Adapter, layer: int, unit: tuple[str, ...]) -> nn.Module | None:
    """The module whose forward runs `unit` (a recompute unit or a span); None for the routed
    experts, their ops and their collective unit (run by the experts' runner) and the LM head
    with the loss (run by the loss runner)."""
    if layer == -1:
        return adapter.decoder.embed_tokens
    if layer == adapter.head_index:
        return {("final_norm",): adapter.decoder.norm, ("lm_head",): adapter.model.lm_head}.get(unit)
    part = adapter.layers[layer]
    if set(unit) == set(adapter.layer_ops(part)):
        return part.module
    if unit[0] in ATTENTION_OPS:
        return part.module.self_attn
    if unit in (EXPERT_OPS, COLLECTIVE_OPS):
        return None
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


def block_kind(adapter: Adapter, layer: int) -> tuple[str, tuple[str, ...]]:
    """The block's kind and ops, as the cost model names them."""
    if layer == -1:
        return "embed", ("embed",)
    if layer == adapter.head_index:
        return "head", ("final_norm", "lm_head", "loss")
    part = adapter.layers[layer]
    return "moe" if part.moe else "dense", tuple(adapter.layer_ops(part))


def block_units(adapter: Adapter, layer: int) -> tuple[tuple[str, ...], ...]:
    """The block's recompute units, as the analytic and profiled cost models have them, with its
    collective unit under expert parallelism (`BlockGraph.collective`)."""
    kind, ops = block_kind(adapter, layer)
    together = collective_unit(ops)
    return standard_units(kind, ops, shared_alone=adapter.family.shared_expert_alone) + ((together,) if together else ())


def block_spans(adapter: Adapter, layer: int) -> tuple[tuple[str, ...], ...]:
    """The block's spans, as the analytic and profiled cost models have them."""
    return standard_spans(*block_kind(adapter, layer))

