"""A supported causal LM's forward as pieces: the embedding, each decoder layer, and the final
norm with the LM head and loss, run one at a time with what they share passed in, never kept on a
module (two micro-batches may be in flight at once: the dual-batch executor, paper §V-B).

Positions, RoPE tables and attention masks are made once per micro-batch and shared by the
layers, as HF's decoder makes them for full sequences without padding (and as the cost model
counts them): a causal mask, or a sliding-window one for the layers whose `config.layer_types`
say so (gpt-oss, Qwen2-MoE) or for every layer of a config with a `sliding_window` and no layer
types (Mixtral, Qwen3-MoE). The pieces run the HF model's own modules, so a model run piece by
piece is bitwise equal to its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..adapters import Adapter
from .head import head_loss


@dataclass(frozen=True)
class LayerInputs:
    """What every decoder layer of one micro-batch receives besides the hidden states."""

    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    masks: dict[str, torch.Tensor | None]  # per layer kind


def layer_kind(adapter: Adapter, layer: int) -> str:
    types = getattr(adapter.config, "layer_types", None)
    return types[layer] if types else "default"


def layer_inputs(adapter: Adapter, hidden_states: torch.Tensor, layers) -> LayerInputs:
    """Positions, RoPE tables and the masks of the kinds of `layers`, for `hidden_states`."""
    config = adapter.config
    position_ids = torch.arange(hidden_states.size(1), device=hidden_states.device).unsqueeze(0)
    position_embeddings = adapter.decoder.rotary_emb(hidden_states, position_ids)
    sliding = getattr(config, "sliding_window", None) is not None
    masks = {}
    for kind in {layer_kind(adapter, i) for i in layers}:
        window = kind == "sliding_attention" or (kind == "default" and sliding)
        # no mask given, no cache: positionally, as the cache's keyword was renamed within 5.x (past_key_values, cache)
        masks[kind] = (create_sliding_window_causal_mask if window else create_causal_mask)(
            config, hidden_states, None, None, position_ids=position_ids
        )
    return LayerInputs(position_ids, position_embeddings, masks)


def embed(adapter: Adapter, input_ids: torch.Tensor) -> torch.Tensor:
    return adapter.decoder.embed_tokens(input_ids)


def decoder_layer(adapter: Adapter, layer: int, hidden_states: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
    out = adapter.layers[layer].module(
        hidden_states,
        attention_mask=inputs.masks[layer_kind(adapter, layer)],
        position_ids=inputs.position_ids,
        position_embeddings=inputs.position_embeddings,
    )
    return out[0] if isinstance(out, tuple) else out


def head(adapter: Adapter, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The final norm, the LM head and the model's loss (through `runtime.head.head_loss`, so a
    plan's head region and chunked loss apply)."""
    return head_loss(adapter.model)(adapter.decoder.norm(hidden_states), labels)
