"""Every other patcher of the model is supported or named: routed experts that do not run
transformers' experts dispatch (Liger-Kernel's real patch functions, a user's class patch), a
causal LM forward replaced (Liger's fused linear cross-entropy), a module compiled on its own, a
hooked module replaced after the plugin installed. Each is refused as the next training forward
begins, naming the module, the patcher and what to do, before anything of it runs."""

import copy

import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.costmodel import OpId
from bagualu_plugin.runtime.plan_runtime import PlanRuntime

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
PLAN = {OpId(1, "expert_fc1"): "recompute", OpId(1, "mlp_norm"): "recompute"}


@pytest.fixture
def restored():
    """Liger's patch functions also replace names in transformers' modeling module and the causal
    LM's forward on its class: put them back after the test."""
    names = dict(vars(modeling_qwen3_moe))
    forward = modeling_qwen3_moe.Qwen3MoeForCausalLM.forward
    experts_forward = modeling_qwen3_moe.Qwen3MoeExperts.forward
    yield
    for name in set(vars(modeling_qwen3_moe)) - set(names):
        delattr(modeling_qwen3_moe, name)
    for name, value in names.items():
        setattr(modeling_qwen3_moe, name, value)
    modeling_qwen3_moe.Qwen3MoeForCausalLM.forward = forward
    modeling_qwen3_moe.Qwen3MoeExperts.forward = experts_forward


def _train_step(model, runtime: PlanRuntime) -> None:
    runtime.micro_batches.running = 0
    with runtime.forward():
        loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()


def _installed(model) -> PlanRuntime:
    runtime = PlanRuntime(model).install()
    runtime.set_plan(PLAN)
    return runtime


def _refused(model, runtime: PlanRuntime, *texts: str) -> None:
    try:
        with pytest.raises(ValueError) as refused:
            _train_step(model, runtime)
    finally:
        runtime.remove()
    for text in texts:
        assert text in str(refused.value), str(refused.value)


def test_an_unpatched_model_trains_and_a_kernelized_norm_is_supported():
    model = tiny_model("qwen3_moe")
    runtime = _installed(model)
    norm = model.model.layers[1].post_attention_layernorm
    norm.forward = norm.forward  # set on the instance, as kernelize and Liger's norms do: the region replays it
    _train_step(model, runtime)
    runtime.remove()


@pytest.mark.parametrize("when", ["before", "after"])
def test_liger_experts_are_refused_by_name(restored, when):
    monkey_patch = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    model = tiny_model("qwen3_moe", mlp_only_layers=[])  # Liger's patch takes every layer's MLP for experts
    patch = lambda: monkey_patch.apply_liger_kernel_to_qwen3_moe(  # noqa: E731
        rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=False, swiglu=True, model=model)
    if when == "before":
        patch()
    runtime = _installed(model)
    if when == "after":
        patch()
    _refused(model, runtime, "model.layers.0.mlp.experts runs liger_kernel.transformers.swiglu.LigerExperts.forward",
             "set on the instance", "not transformers' experts dispatch", "swiglu=False")


def test_liger_fused_linear_cross_entropy_is_refused_by_name(restored):
    monkey_patch = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    model = tiny_model("qwen3_moe")
    runtime = _installed(model)
    monkey_patch.apply_liger_kernel_to_qwen3_moe(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False,
                                                 swiglu=False, model=model)
    _refused(model, runtime, "the model's forward is liger_kernel.", "set on the instance",
             "not Qwen3MoeForCausalLM's own", "fused_linear_cross_entropy=False")


def test_a_users_class_patch_of_the_experts_is_refused(restored):
    model = tiny_model("qwen3_moe")
    runtime = _installed(model)
    experts_class = type(model.model.layers[1].mlp.experts)

    def my_experts(self, hidden_states, top_k_index, top_k_weights):
        return torch.zeros_like(hidden_states)

    experts_class.forward = my_experts
    _refused(model, runtime, "runs test_patches.test_a_users_class_patch_of_the_experts_is_refused.<locals>.my_experts",
             "on the class Qwen3MoeExperts")


@pytest.mark.parametrize("how", ["layer.compile()", "torch.compile(layer)"])
def test_a_layer_compiled_on_its_own_is_refused_before_it_runs(how):
    model = tiny_model("qwen3_moe")
    runtime = _installed(model)
    layer = model.model.layers[1]
    if how == "layer.compile()":
        layer.compile()
    else:
        model.model.layers[1] = torch.compile(layer)
    _refused(model, runtime, "model.layers.1 compiled on its own")


def test_a_hooked_module_replaced_after_install_is_refused():
    model = tiny_model("qwen3_moe")
    runtime = _installed(model)
    layer = model.model.layers[1]
    layer.post_attention_layernorm = copy.deepcopy(layer.post_attention_layernorm)
    _refused(model, runtime, "model.layers.1.post_attention_layernorm replaced after the plugin installed", "prov.remove()")


def test_a_wrapper_calling_the_experts_dispatch_is_supported():
    """A function set on the experts that calls the forward it replaced (a logging wrapper, without
    functools.wraps) still runs the plugin's expert ops: the forward shows it, and it trains."""
    model = tiny_model("qwen3_moe")
    runtime = _installed(model)
    experts = model.model.layers[1].mlp.experts
    inner, calls = experts.forward, []

    def logged(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    experts.forward = logged
    try:
        _train_step(model, runtime)
    finally:
        runtime.remove()
    assert calls
