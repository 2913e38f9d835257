"""The LM head and loss: recomputed through the loss runner (bitwise, tests/test_mitigation.py runs
every strategy on every op), and the chunked linear + cross-entropy (`loss_chunk_tokens`).

The chunked loss is not bitwise equal to HF's `ForCausalLMLoss`; its stated tolerance, relative:
loss within 1e-6 (FP32 and BF16: the loss is FP32 in both), gradients (relative L2 error over all
of them) within 1e-6 in FP32 and 2^-8 (one BF16 rounding) in BF16, measured at most 2.1e-7 and
6.0e-5 (the bias gradient). Through a BF16 model the logits' gradient, where one rounding differs,
runs back through every layer's BF16 backward: 2^-7 there, measured at most 2.8e-3 (qwen3_moe);
FP32 models stay under 1e-6 (measured 2.6e-7).
"""

from dataclasses import replace

import pytest
import torch
import yaml
from helpers import plan_step, relative_error
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

import bagualu_plugin as bgl
from bagualu_plugin.adapters import FAMILIES, Adapter, tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.config import Recipe, RecipeError, builtin_recipes
from bagualu_plugin.costmodel import CostModel, Forward, ModelDims, OpId
from bagualu_plugin.costmodel.mitigation import MitigationOptions
from bagualu_plugin.runtime.chunked_loss import chunked_causal_lm_loss
from bagualu_plugin.runtime.plan_runtime import apply_plan
from bagualu_plugin.stage import Stage

LOSS_TOLERANCE = 1e-6
GRAD_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2**-8}
MODEL_GRAD_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2**-7}
IDS = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
LABELS = IDS.clone()
CHUNKED = MitigationOptions(loss_chunk_tokens=40)  # 96 tokens: two full chunks and a partial one


def _step(loss_of, params):
    for p in params:
        p.grad = None
    loss = loss_of()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "kwargs", [{}, {"num_items_in_batch": torch.tensor(250)}, {"ignore_index": 5}, {"shift_labels": "given"}],
    ids=["mean", "num_items", "ignore_index", "shift_labels"],
)
def test_chunked_loss_matches_hf_loss(dtype, bias, kwargs):
    """HF's ForCausalLMLoss semantics: shifted labels with ignored positions, mean over kept
    tokens or sum over num_items_in_batch, another ignore_index, labels shifted by the caller."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden_size = 1000, 64
    head = nn.Linear(hidden_size, vocab, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.normal_(0, 0.3, generator=g)
    hidden = torch.randn(3, 100, hidden_size, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (3, 100), generator=g)
    labels[:, :7] = kwargs.get("ignore_index", -100)
    if kwargs.get("shift_labels") == "given":
        kwargs = {"shift_labels": labels.roll(-1, dims=1)}
    params = [hidden, *head.parameters()]
    reference = _step(lambda: ForCausalLMLoss(head(hidden), labels, vocab, **kwargs), params)
    chunked = _step(lambda: chunked_causal_lm_loss(hidden, head, labels, 64, **kwargs), params)
    assert chunked[0].dtype == reference[0].dtype == torch.float32
    assert ((chunked[0] - reference[0]).abs() / reference[0].abs()).item() <= LOSS_TOLERANCE
    assert relative_error(chunked[1], reference[1]) <= GRAD_TOLERANCE[dtype]


def run(model, plan=None, options=MitigationOptions()):
    """Loss, gradients, saved bytes and the shape of the returned logits of one step on IDS."""
    loss, grads, saved, out = plan_step(model, IDS, plan or {}, labels=LABELS, options=options, output=True)
    return loss, grads, saved, out.logits.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_loss_on_every_family_is_within_tolerance_and_predicted(family, dtype):
    """Through the runtime, kept, recomputed or offloaded: the returned logits are empty, the
    loss and gradients within the stated tolerance, the Ledger's bytes the analytic model's."""
    model = tiny_model(family, dtype=dtype)
    cm = model_cost(model)
    loss0, grads0, keep, logits = run(model)
    assert logits == (2, 48, model.config.vocab_size)
    head = Adapter(model).head_index
    plans = [{}, cm.full_recompute(), {OpId(head, "loss"): "recompute", OpId(head, "lm_head"): "offload"}]
    for plan in plans:
        loss, grads, saved, logits = run(model, plan, CHUNKED)
        assert logits == (2, 0, model.config.vocab_size)
        assert ((loss - loss0).abs() / loss0).item() <= LOSS_TOLERANCE, plan
        assert relative_error(grads, grads0) <= MODEL_GRAD_TOLERANCE[dtype], plan
        assert saved == cm.activation_bytes(96, seq_len=48, plan=plan, options=CHUNKED), plan
    # the chunked loss keeps one FP32 log-sum-exp per token instead of the FP32 log-probabilities
    assert keep - run(model, {}, CHUNKED)[2] == 96 * model.config.vocab_size * 4 - 96 * 4


def test_without_labels_or_gradients_the_forward_is_hf_s_own():
    model = tiny_model("mixtral")
    head = Adapter(model).head_index
    with torch.no_grad():
        reference = model(input_ids=IDS, labels=LABELS)
    with apply_plan(model, {OpId(head, "loss"): "recompute"}, options=CHUNKED):
        assert torch.equal(model(input_ids=IDS).logits, reference.logits)
        with torch.no_grad():
            evaluated = model(input_ids=IDS, labels=LABELS)
    assert torch.equal(evaluated.logits, reference.logits) and torch.equal(evaluated.loss, reference.loss)


def test_cost_model_prices_the_head_s_loss_region():
    """Recomputing the loss drops the log-probabilities and targets and holds the labels; the
    chunked loss keeps a log-sum-exp per token and its backward replays the LM head."""
    dims = ModelDims.from_hf_config(tiny_model("qwen3_moe").config, dtype="bf16", attention="sdpa")
    cm = CostModel.from_config(dims, "cpu")
    head, tokens, vocab = dims.num_layers, 100, dims.vocab_size
    keep = cm.footprint(Forward(tokens, 50))
    loss = cm.footprint(Forward(tokens, 50), plan={OpId(head, "loss"): "recompute"})
    assert keep.device_bytes - loss.device_bytes == tokens * vocab * 4 + 4  # targets out, labels held
    lm_head = cm.blocks[head].op("lm_head")
    load = cm.loads(Forward(tokens, 50))[head]
    replay = lm_head.forward_s.at(load) + cm.blocks[head].op("loss").forward_s.at(load)
    assert loss.backward_extra_s == pytest.approx(replay)
    chunked = cm.footprint(Forward(tokens, 50), options=CHUNKED)
    assert keep.device_bytes - chunked.device_bytes == tokens * vocab * 4 - tokens * 4
    assert chunked.backward_extra_s == pytest.approx(lm_head.forward_s.at(cm.loads(Forward(tokens, 50))[head]))
    assert {OpId(head, "lm_head"), OpId(head, "loss")} <= set(cm.full_recompute())


def test_bad_loss_chunk_values_are_rejected():
    for bad in (0, -8, True, 2.5, "64"):
        with pytest.raises(ValueError, match="loss_chunk_tokens must be a positive integer or None"):
            MitigationOptions(loss_chunk_tokens=bad)
    with pytest.raises(RecipeError, match="strategies.loss_chunk_tokens"):
        Recipe.from_dict(_recipe(loss_chunk_tokens=0))
    assert Stage.of(Recipe.from_dict(_recipe(loss_chunk_tokens=4096))).options.loss_chunk_tokens == 4096
    model = tiny_model("qwen3_moe")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(ValueError, match="loss_chunk_tokens replaces transformers' ForCausalLMLoss"):
        with apply_plan(model, {}, options=CHUNKED):
            pass
    assert not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in model.modules())
    del model._loss_function
    cm = model_cost(model)
    head = cm.blocks[Adapter(model).head_index]
    cm.blocks[Adapter(model).head_index] = replace(head, tensors=tuple(replace(t, chunked=None) for t in head.tensors))
    with pytest.raises(ValueError, match="no tensors of the chunked loss"):
        cm.activation_bytes(64, options=CHUNKED)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_profiled_model_predicts_the_chunked_loss(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    cm = bgl.profile(model, [32, 64, 128], repeats=1)
    head = Adapter(model).head_index
    plans = [{}, {OpId(head, "loss"): "recompute"}, {OpId(head, "loss"): "offload"}, cm.full_recompute()]
    for plan in plans:
        for options in (MitigationOptions(), CHUNKED):
            assert run(model, plan, options)[2] == cm.activation_bytes(96, seq_len=48, plan=plan, options=options), (plan, options)


def _recipe(**strategies) -> dict:
    data = yaml.safe_load(builtin_recipes()["qwen3_moe"].read_text())
    return {**data, "strategies": {**data.get("strategies", {}), **strategies}}
