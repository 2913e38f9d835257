"""A supported HF MoE causal LM as nanotron pipeline stages: the embedding, one `PipelineBlock`
per decoder layer, and the final norm with the LM head and HF's causal-LM loss, each block
running on the pipeline rank that holds it (layers split evenly and in order, as
`CostModel.stage` splits them: the embedding on the first rank, the head on the last).

The blocks run the HF model's own modules: the decoder layers with the model's rotary embedding
and a causal mask, the loss with `ForCausalLMLoss` (shifted labels, mean over tokens), so a
stage's saved tensors are the ones the cost model and the Provisioner know. The model is the
whole HF model on every rank here; each block is only built and run on its rank.

nanotron's batch contract: `input_ids` on the first rank and `labels` on the last are tensors,
`TensorPointer`s to those ranks elsewhere; the model returns {"loss": ...} on the last rank.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from ...adapters import Adapter
from .compat import import_nanotron

import_nanotron()

from nanotron.parallel.pipeline_parallel.block import PipelineBlock  # noqa: E402
from nanotron.parallel.pipeline_parallel.p2p import P2P  # noqa: E402


class _Embed(nn.Module):
    def __init__(self, adapter: Adapter):
        super().__init__()
        self.embed_tokens = adapter.decoder.embed_tokens

    def forward(self, input_ids):
        return {"hidden_states": self.embed_tokens(input_ids)}


class _Layer(nn.Module):
    """One decoder layer; positions, RoPE tables and the causal mask made here, as HF's decoder
    makes them for a batch of full sequences without padding."""

    def __init__(self, adapter: Adapter, index: int):
        super().__init__()
        self.layer, self.rotary_emb = adapter.layers[index].module, adapter.decoder.rotary_emb

    def forward(self, hidden_states):
        position_ids = torch.arange(hidden_states.size(1), device=hidden_states.device).unsqueeze(0)
        out = self.layer(
            hidden_states, attention_mask=None, position_ids=position_ids, position_embeddings=self.rotary_emb(hidden_states, position_ids)
        )
        return {"hidden_states": out[0] if isinstance(out, tuple) else out}


class _Head(nn.Module):
    def __init__(self, adapter: Adapter):
        super().__init__()
        self.norm, self.lm_head, self.vocab_size = adapter.decoder.norm, adapter.model.lm_head, adapter.config.vocab_size

    def forward(self, hidden_states, labels):
        return {"loss": ForCausalLMLoss(self.lm_head(self.norm(hidden_states)), labels, self.vocab_size)}


class PipelineModel(nn.Module):
    """`model` (a supported HF MoE causal LM) cut into nanotron `PipelineBlock`s over `p2p`'s
    pipeline group; `pp` must divide its decoder layers."""

    def __init__(self, model: nn.Module, p2p: P2P):
        super().__init__()
        adapter = Adapter(model)
        pp, layers = p2p.pg.size(), len(adapter.layers)
        if layers % pp:
            raise ValueError(f"the pipeline has {pp} ranks, which does not divide the model's {layers} decoder layers")

        def block(builder, inputs: set[str], outputs: set[str], rank: int, **kwargs) -> PipelineBlock:
            b = PipelineBlock(p2p=p2p, module_builder=builder, module_kwargs={"adapter": adapter, **kwargs},
                              module_input_keys=inputs, module_output_keys=outputs)
            b.build_and_set_rank(rank)
            return b

        self.embed = block(_Embed, {"input_ids"}, {"hidden_states"}, 0)
        self.layers = nn.ModuleList(
            block(_Layer, {"hidden_states"}, {"hidden_states"}, i * pp // layers, index=i) for i in range(layers)
        )
        self.head = block(_Head, {"hidden_states", "labels"}, {"loss"}, pp - 1)

    def forward(self, input_ids, labels):
        hidden_states = self.embed(input_ids=input_ids)["hidden_states"]
        for layer in self.layers:
            hidden_states = layer(hidden_states=hidden_states)["hidden_states"]
        return self.head(hidden_states=hidden_states, labels=labels)
