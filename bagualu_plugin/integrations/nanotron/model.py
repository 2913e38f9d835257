"""A supported HF MoE causal LM as nanotron pipeline stages: the embedding, one `PipelineBlock`
per pipeline rank's decoder layers, and the final norm with the LM head and loss, each block
running on the pipeline rank that holds it (layers split evenly and in order, as
`CostModel.stage` splits them: the embedding on the first rank, the head on the last).

The blocks run the HF model's own modules: the decoder layers with the model's rotary embedding
and a causal mask, the head with the model's loss function (HF's `ForCausalLMLoss`: shifted
labels, mean over tokens) through `runtime.head.head_loss`, so a stage's saved tensors are the
ones the cost model and the Provisioner know, and a plan's head region applies. Each rank builds
and runs only its blocks; `stage_state` names what it must load (`parallel.load_pretrained`),
the rest of the model staying on the meta device.

Tied embeddings (`tie_word_embeddings`): the first stage's embedding and the last stage's LM head
are one parameter in two processes; `tied_parameters` lists it on those two ranks, whose
gradients the launcher sums, as Megatron-LM does for its embedding group.

nanotron's batch contract: `input_ids` on the first rank and `labels` on the last are tensors,
`TensorPointer`s to those ranks elsewhere; the model returns {"loss": ...} on the last rank.
"""

from __future__ import annotations

from torch import nn

from ...adapters import Adapter
from ...costmodel.pipeline import stage_layers
from ...runtime import pieces
from .compat import import_pipeline

import_pipeline()

from nanotron.parallel.pipeline_parallel.block import PipelineBlock  # noqa: E402
from nanotron.parallel.pipeline_parallel.p2p import P2P  # noqa: E402


class _Embed(nn.Module):
    def __init__(self, adapter: Adapter):
        super().__init__()
        self.embed_tokens = adapter.decoder.embed_tokens

    def forward(self, input_ids):
        return {"hidden_states": self.embed_tokens(input_ids)}


class _Decoder(nn.Module):
    """A pipeline rank's decoder layers, sharing one micro-batch's positions, RoPE tables and
    masks (`runtime.pieces`)."""

    def __init__(self, adapter: Adapter, layers: range):
        super().__init__()
        self.layers = nn.ModuleList(adapter.layers[i].module for i in layers)
        self.rotary_emb = adapter.decoder.rotary_emb
        self._adapter, self._indices = [adapter], layers  # in a list: not a submodule of the block

    def forward(self, hidden_states):
        adapter = self._adapter[0]
        inputs = pieces.layer_inputs(adapter, hidden_states, self._indices)
        for i in self._indices:
            hidden_states = pieces.decoder_layer(adapter, i, hidden_states, inputs)
        return {"hidden_states": hidden_states}


class _Head(nn.Module):
    def __init__(self, adapter: Adapter):
        super().__init__()
        self.norm, self.lm_head = adapter.decoder.norm, adapter.model.lm_head
        self._adapter = [adapter]  # in a list: not a submodule of the block

    def forward(self, hidden_states, labels):
        return {"loss": pieces.head(self._adapter[0], hidden_states, labels)}


def stage_modules(model: nn.Module, pp: int, rank: int) -> list[nn.Module]:
    """The modules pipeline rank `rank` runs: its decoder layers, the rotary embedding, the
    embedding on the first rank, the final norm and LM head on the last."""
    a = Adapter(model)
    modules = [a.layers[i].module for i in stage_layers(len(a.layers), pp, rank)] + [a.decoder.rotary_emb]
    if rank == 0:
        modules.append(a.decoder.embed_tokens)
    if rank == pp - 1:
        modules += [a.decoder.norm, a.model.lm_head]
    return modules


def stage_state(pp: int, rank: int):
    """For `parallel.load_pretrained(keep=...)`: the state-dict names of rank `rank`'s modules."""

    def keep(model: nn.Module) -> set[str]:
        held = {id(t) for m in stage_modules(model, pp, rank) for t in m.state_dict(keep_vars=True).values()}
        return {name for name, t in model.state_dict(keep_vars=True).items() if id(t) in held}

    return keep


class PipelineModel(nn.Module):
    """`model` (a supported HF MoE causal LM) cut into nanotron `PipelineBlock`s over `p2p`'s
    pipeline group; `pp` must divide its decoder layers."""

    def __init__(self, model: nn.Module, p2p: P2P):
        super().__init__()
        adapter = Adapter(model)
        self.p2p, self._causal_lm = p2p, [model]  # in a list: the blocks hold its modules already
        pp, layers = p2p.pg.size(), len(adapter.layers)
        embed, head = adapter.decoder.embed_tokens.weight, adapter.model.lm_head.weight
        self.tied = embed is head  # tie_word_embeddings, known on every rank
        self._tied = [embed] if pp > 1 and self.tied and p2p.pg.rank() in (0, pp - 1) else []

        def block(builder, inputs: set[str], outputs: set[str], rank: int, **kwargs) -> PipelineBlock:
            b = PipelineBlock(p2p=p2p, module_builder=builder, module_kwargs={"adapter": adapter, **kwargs},
                              module_input_keys=inputs, module_output_keys=outputs)
            b.build_and_set_rank(rank)
            return b

        self.embed = block(_Embed, {"input_ids"}, {"hidden_states"}, 0)
        self.stages = nn.ModuleList(
            block(_Decoder, {"hidden_states"}, {"hidden_states"}, r, layers=stage_layers(layers, pp, r)) for r in range(pp)
        )
        self.head = block(_Head, {"hidden_states", "labels"}, {"loss"}, pp - 1)

    @property
    def causal_lm(self) -> nn.Module:
        """The HF model the blocks run (`runtime.dual_batch.StagePieces` runs it piece by piece)."""
        return self._causal_lm[0]

    def tied_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank shares with another pipeline rank (tied embeddings on the first
        and last rank): their gradients are summed over the two."""
        return self._tied

    def forward(self, input_ids, labels):
        hidden_states = self.embed(input_ids=input_ids)["hidden_states"]
        for stage in self.stages:
            hidden_states = stage(hidden_states=hidden_states)["hidden_states"]
        return self.head(hidden_states=hidden_states, labels=labels)
