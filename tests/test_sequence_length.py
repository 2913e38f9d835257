"""`seq_len` where the model keeps per-sequence tensors (docs/architecture.md): required, and exact
against the Ledger on a real tiny model whose micro-batches hold several sequences."""

import pytest
import torch

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.costmodel import BlockGraph, CostModel, Forward, LinearForm, ModelDims, OpSpec, TensorSpec
from bagualu_plugin.hardware import preset
from bagualu_plugin.runtime.profiler import measure_micro_batch, profile


@pytest.fixture(scope="module")
def glm_eager():
    model = tiny_model("glm4_moe")
    model.set_attn_implementation("eager")
    return model


@pytest.fixture(scope="module", params=["analytic", "profiled"])
def glm_eager_cost(request, glm_eager):
    return model_cost(glm_eager) if request.param == "analytic" else profile(glm_eager, [16, 32, 64], repeats=1)


@pytest.mark.parametrize("batch, seq_len", [(3, 100), (5, 90)])
def test_several_sequences_are_predicted_exactly(glm_eager, glm_eager_cost, batch, seq_len):
    ids = torch.randint(0, 128, (batch, seq_len), generator=torch.Generator().manual_seed(3))
    saved, routed, _ = measure_micro_batch(glm_eager, ids, repeats=0)
    tokens, pairs = batch * seq_len, [routed[i] for i in glm_eager_cost.moe_layers]
    assert glm_eager_cost.activation_bytes(tokens, routed=pairs, seq_len=seq_len) == saved
    # what a missing seq_len would have meant: one sequence of all the tokens, far too high
    assert glm_eager_cost.activation_bytes(tokens, routed=pairs, seq_len=tokens) > 1.4 * saved


def test_missing_seq_len_is_an_error_naming_it(glm_eager_cost):
    cm = glm_eager_cost
    with pytest.raises(ValueError, match=r"seq_len is required: .*attn_core.*per_score"):
        cm.activation_bytes(300)
    for query in (cm.footprint, cm.micro_batch, cm.op_costs):
        with pytest.raises(ValueError, match=r"seq_len is required: .*attn_core.*per_score"):
            query(Forward(300))
    with pytest.raises(TypeError, match=r"forward: expected a costmodel.Forward"):
        cm.footprint(300)
    with pytest.raises(ValueError, match="seq_len is required"):
        cm.mitigation_cost(cm.ops()[0], "recompute", Forward(300))


def _dims(**kw) -> ModelDims:
    return ModelDims(
        family="qwen3_moe", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=128, num_experts=8, top_k=2, moe_intermediate_size=32, dtype="fp32", **kw,
    )


def test_per_micro_batch_terms_need_no_seq_len():
    """sdpa keeps one RoPE table per micro-batch: one sequence of T reads it at T positions (and
    keeps the loss's targets as a view of its padded labels, one more row)."""
    cm = CostModel.from_config(_dims(), preset("cpu"))
    assert cm.per_sequence_tensors == []
    cos_and_sin = 2 * 16 * 4  # bytes per position
    assert cm.activation_bytes(300) - cm.activation_bytes(300, seq_len=100) == cos_and_sin * (300 - 100) + 8


def test_a_model_independent_of_sequences_needs_no_seq_len():
    block = BlockGraph("moe", (OpSpec("a", (), LinearForm(), LinearForm()),), (TensorSpec("t", "a", ("a",), LinearForm(per_token=3), 4),))
    cm = CostModel({0: block}, preset("cpu"), pairs_per_token=1.0)
    assert cm.activation_bytes(10) == cm.activation_bytes(10, seq_len=5) == 120


@pytest.mark.parametrize("term", ["per_score", "per_sequence", "per_single_token"])
def test_each_per_sequence_term_requires_seq_len(term):
    block = BlockGraph("moe", (OpSpec("a", (), LinearForm(), LinearForm()),), (TensorSpec("t", "a", ("a",), LinearForm(**{term: 1}), 4),))
    cm = CostModel({0: block}, preset("cpu"), pairs_per_token=1.0)
    with pytest.raises(ValueError, match=f"seq_len is required: .*0.t \\({term}\\)"):
        cm.activation_bytes(10)
    assert cm.activation_bytes(10, seq_len=10) > 0  # one sequence, said so
