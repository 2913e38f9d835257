"""PEFT LoRA on every family: the cost model knows that only the adapters train (`ModelDims.lora`,
read off the model by `model_dims`) and predicts what autograd then saves to the byte: nothing
before the first adapter, no input of a frozen linear, what each adapter and its dropout keep,
the fused expert weights with their LoRA folded in. Under every single-op plan the loss and every
adapter's gradient stay bitwise, a recompute replaying LoRA's dropout with the forward's RNG and
the experts' LoRA weights after their forward has ended."""

import pytest
import torch
from helpers import plan_step
from peft import LoraConfig, get_peft_model, inject_adapter_in_model
from pydantic import ValidationError

import bagualu_plugin as bgl
from bagualu_plugin.adapters import FAMILIES, tiny_model
from bagualu_plugin.adapters.costs import model_cost, model_dims
from bagualu_plugin.costmodel import CostModel, ForwardKind, ModelDims, OpId
from bagualu_plugin.costmodel.dims import EXPERT_TARGETS, param_count

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
SHAPES = ((2, 16), (1, 24))  # several sequences, and one (its own views: the loss's padded labels)


def lora(family: str, dropout: float = 0.0, experts: bool = False, dtype=torch.float32, **config):
    """A tiny model of `family` with rank-4 LoRA on attention (and on the fused experts: PEFT
    adapts them only without dropout)."""
    targets = MLA if FAMILIES[family].mla else ATTENTION
    config = {"target_modules": targets, "target_parameters": list(EXPERT_TARGETS) if experts else None, **config}
    return get_peft_model(tiny_model(family, dtype=dtype), LoraConfig(r=4, lora_dropout=dropout, **config))


def run(model, plan, ids, backward: bool = True):
    """Loss, adapter gradients (none without `backward`) and saved bytes of one step; the same
    dropout masks every time."""
    return plan_step(model, ids, plan, seed=0, backward=backward, grads="trainable")


@pytest.mark.parametrize("adapters", ["attention+experts", "attention, dropout 0.1"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_single_op_plan_is_predicted_and_exact(family, adapters):
    model = lora(family, experts=True) if "experts" in adapters else lora(family, dropout=0.1)
    cm = model_cost(model)
    plans = [{op: strategy} for op in bgl.list_ops(model) for strategy in ("recompute", "offload")]
    for i, (batch, seq_len) in enumerate(SHAPES):  # gradients at the first shape, bytes at both
        ids = torch.randint(0, 128, (batch, seq_len), generator=torch.Generator().manual_seed(batch))
        loss0, grads0, keep = run(model, {}, ids, backward=i == 0)
        assert keep == cm.activation_bytes(batch * seq_len, seq_len=seq_len)
        for plan in plans:
            loss, grads, saved = run(model, plan, ids, backward=i == 0)
            assert saved == cm.activation_bytes(batch * seq_len, seq_len=seq_len, plan=plan), (seq_len, plan)
            assert torch.equal(loss, loss0) and all(torch.equal(g, r) for g, r in zip(grads, grads0, strict=True)), plan


@pytest.mark.parametrize("training", ["full", "attention+experts", "attention, dropout 0.1", "all-linear"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_autocast_to_the_model_dtype_is_predicted_and_exact(family, training):
    """A BF16 checkpoint under autocast to BF16 (the Trainer's bf16=True, TRL's default): an FP32
    router (DeepSeek-V3, GLM-4-MoE) computes in BF16 on cast copies of its input and weight, PEFT's
    FP32 adapters on cast copies of their input and weights, an adapted router's B A on casts of
    both (`ModelDims.autocast`). Predicted to the byte with and without the ops it changes
    mitigated, gradients bitwise."""
    if training == "full":
        model = tiny_model(family, dtype=torch.bfloat16)
    elif training == "all-linear":  # the router's weight too
        model = get_peft_model(tiny_model(family, dtype=torch.bfloat16), LoraConfig(r=4, target_modules="all-linear"))
    else:
        dropout, experts = (0.1, False) if "dropout" in training else (0.0, True)
        model = lora(family, dropout=dropout, experts=experts, dtype=torch.bfloat16)
    cm, plain = model_cost(model, kind=ForwardKind(autocast="bf16")), model_cost(model)
    moe = cm.moe_layers[0]
    changed = training != "full" or FAMILIES[family].router_fp32  # elsewhere autocast casts nothing: all is BF16 already
    assert model_dims(model).autocast is None and (cm.blocks[moe] != plain.blocks[moe]) == changed
    ops = [OpId(moe, op) for op in ("attn_qkv", "router", "expert_fc1", "expert_fc2")]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss0, grads0, keep = plan_step(model, ids, {}, seed=0, grads="trainable", autocast=torch.bfloat16)
    assert keep == cm.activation_bytes(32, seq_len=16)
    for plan in [{op: strategy} for op in ops for strategy in ("recompute", "offload")]:
        loss, grads, saved = plan_step(model, ids, plan, seed=0, grads="trainable", autocast=torch.bfloat16)
        assert saved == cm.activation_bytes(32, seq_len=16, plan=plan), plan
        assert torch.equal(loss, loss0) and all(torch.equal(g, r) for g, r in zip(grads, grads0, strict=True)), plan


def test_frozen_weights_save_less_than_training_them():
    """The cost model of the whole model training, which is what `model_cost` predicted before it
    read the adapters, is far off; the LoRA one is exact (above) and keeps a frozen layer's
    input only where an adapter reads it."""
    model = lora("qwen3_moe")
    full = CostModel.from_config(ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa"), "cpu")
    assert model_cost(model).activation_bytes(32, seq_len=16) == 339268 < 530116 == full.activation_bytes(32, seq_len=16)
    block = model_cost(model).blocks[0]  # its input needs no gradient: no norm saves, q, k, v made by adapters
    assert not {"x", "attn_norm.rstd"} & {t.name for t in block.tensors if t.savers}
    assert {"self_attn.q_proj.lora_a", "attn_core.lse"} <= {t.name for t in block.tensors if t.savers}


def test_model_dims_reads_the_adapters():
    plain = tiny_model("qwen2_moe")
    assert model_dims(plain) == ModelDims.from_hf_config(plain.config, dtype="fp32", attention="sdpa")
    some = lora("glm4_moe", dropout=0.05, layers_to_transform=[1])
    assert model_dims(some).lora.layers == [1] and model_dims(some).lora.dropout == 0.05
    assert run(some, {}, torch.randint(0, 128, (2, 16)))[2] == model_cost(some).activation_bytes(32, seq_len=16)  # layer 0 saves nothing
    config = LoraConfig(r=4, lora_dropout=0.05, target_modules=ATTENTION, layers_to_transform=[1])
    injected = inject_adapter_in_model(config, tiny_model("glm4_moe"))  # PEFT's layers in a plain model
    assert model_dims(injected).lora == model_dims(some).lora
    # "all-linear" on BF16: PEFT adapts the fused experts (gate_up_proj at twice the rank) and the
    # router's weight, and keeps the adapters in FP32 (autocast_adapter_dtype)
    model = get_peft_model(tiny_model("qwen3_moe", dtype=torch.bfloat16), LoraConfig(r=4, target_modules="all-linear"))
    dims, cm = model_dims(model), model_cost(model)
    assert dims.dtype == "bf16" and dims.lora.dtype == "fp32"
    assert dims.lora.rank == 4 and dims.lora.ranks == {EXPERT_TARGETS[0]: 8} and dims.lora.layers is None
    assert {"mlp.gate.weight", *EXPERT_TARGETS, "self_attn.q_proj"} <= set(dims.lora.targets)
    ids = torch.randint(0, 128, (2, 16))
    loss0, grads0, _ = run(model, {}, ids)
    for plan in [{}] + [{OpId(1, op): s} for op in ("router", "expert_fc1", "expert_fc2") for s in ("recompute", "offload")]:
        loss, grads, saved = run(model, plan, ids)
        assert saved == cm.activation_bytes(32, seq_len=16, plan=plan), plan
        assert torch.equal(loss, loss0) and all(torch.equal(g, r) for g, r in zip(grads, grads0, strict=True)), plan
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert param_count(dims, trainable=True) == sum(cm.parameter_counts(trainable=True)) == trainable


def test_static_bytes_count_gradients_and_optimizer_state_of_the_adapters_only():
    model = lora("mixtral", experts=True)
    cm = model_cost(model)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    expert = sum(k for n, k in trainable.items() if ".experts." in n)
    dense = sum(trainable.values()) - expert
    assert cm.parameter_counts(trainable=True) == (dense, expert)
    weights = sum(cm.parameter_counts()) * 2
    assert cm.static_bytes(2, 4, 8) == weights + (dense + expert) * (4 + 8)
    assert cm.static_bytes(2, 4, 8, dense_shards=2, expert_shards=4) == weights + dense * (4 + 4) + expert * (4 + 2)
    layer = cm.blocks[0].dense_params + cm.blocks[0].expert_params
    assert cm.fsdp_static_bytes(2, 4, 8, shards=4) == (weights + (dense + expert) * 12) / 4 + 2 * layer * 2


def test_what_the_cost_model_cannot_describe_is_refused_by_name():
    base = model_dims(tiny_model("qwen3_moe"))
    spec = {"rank": 4, "targets": ["self_attn.q_proj"]}
    with pytest.raises(ValidationError, match=r"lora\.targets: \['mlp.router.weight'\] are no linears"):
        ModelDims.model_validate({**dict(base), "lora": {**spec, "targets": ["mlp.router.weight"]}})  # qwen3's router is `gate`
    with pytest.raises(ValidationError, match=r"lora\.dropout: PEFT adapts the fused expert weights .* only without dropout"):
        ModelDims.model_validate({**dict(base), "lora": {**spec, "targets": [EXPERT_TARGETS[0]], "dropout": 0.1}})
    with pytest.raises(ValidationError, match=r"lora\.layers: \[3\] are past the last layer"):
        ModelDims.model_validate({**dict(base), "lora": {**spec, "layers": [3]}})
    with pytest.raises(ValueError, match="outside the decoder layers .*lm_head"):
        model_dims(lora("qwen3_moe", target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="parameters outside the adapters train .*norm"):
        model_dims(lora("qwen3_moe", modules_to_save=["norm"]))
    with pytest.raises(ValueError, match="plain LoRA adapter"):
        model_dims(lora("qwen3_moe", use_dora=True))


def test_profile_of_a_peft_model_agrees_with_the_analytic_model():
    """Qwen2-MoE: a dense first layer, the gated shared expert first; attention and experts adapted."""
    model = lora("qwen2_moe", experts=True)
    profiled, analytic = bgl.profile(model, [8, 12, 16], repeats=1), model_cost(model)
    plans = [{}] + [{op: strategy} for op in bgl.list_ops(model) for strategy in ("recompute", "offload")]
    for plan in plans:
        for tokens, seq_len in ((40, 20), (24, 24)):  # shapes it never ran
            predicted = analytic.activation_bytes(tokens, seq_len=seq_len, plan=plan)
            assert profiled.activation_bytes(tokens, seq_len=seq_len, plan=plan) == predicted, plan
    assert profiled.parameter_counts(trainable=True) == analytic.parameter_counts(trainable=True)
