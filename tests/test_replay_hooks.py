"""A recompute region's replay runs what its forward ran: the forward pre-hooks and hooks of the
region's module, another library's or the user's, registered before or after the plugin installed
(a logging or noise hook, an argument rewritten, an output changed without saving anything).
Gradients are bitwise those of the same hooked model without the plugin."""

import pytest
import torch
from helpers import plan_step, tiny_recipe

import bagualu_plugin as bgl
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.costmodel import OpId
from bagualu_plugin.runtime.plan_runtime import PlanRuntime

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _noise(module, args, output):
    """A term computed from the input, which saves a tensor for backward (tanh keeps its output)."""
    return output + 0.1 * torch.tanh(args[0])


def _rewrite(module, args):
    """An argument rewritten before the forward (saves nothing: a product by a number)."""
    return (args[0] * 1.5,)


def _scale(module, args, output):
    """The output changed without saving anything: a replay skipping it computes from other values."""
    return output * 0.5


HOOKS = {"saving forward hook": ("forward", _noise), "argument-rewriting pre-hook": ("pre", _rewrite),
         "output hook that saves nothing": ("forward", _scale)}


def _hook(model, kind: str, fn) -> list:
    norms = [layer.post_attention_layernorm for layer in model.model.layers]
    return [n.register_forward_hook(fn) if kind == "forward" else n.register_forward_pre_hook(fn) for n in norms]


def _runtime_step(model, runtime: PlanRuntime):
    model.zero_grad(set_to_none=True)
    runtime.micro_batches.running = 0
    with runtime.forward():
        loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(HOOKS))
@pytest.mark.parametrize("when", ["before the plugin", "after the plugin"])
@pytest.mark.parametrize("unit", ["mlp_norm", "layer"])
def test_a_region_replays_its_modules_hooks(name, when, unit):
    """The norm alone a region (mlp_norm), or inside a whole-layer region; the hook registered
    before the plugin installed or after it."""
    kind, fn = HOOKS[name]
    model = tiny_model("qwen3_moe", num_hidden_layers=3)
    handles = _hook(model, kind, fn)
    loss, grads, _ = plan_step(model, IDS)
    for h in handles:
        h.remove()
    ops = [op for op in PlanRuntime(model).adapter.ops() if op.layer in (0, 1, 2)]
    plan = {OpId(i, "mlp_norm"): "recompute" for i in range(3)} if unit == "mlp_norm" else dict.fromkeys(ops, "recompute")
    if when == "before the plugin":
        handles = _hook(model, kind, fn)
    runtime = PlanRuntime(model).install()
    if when == "after the plugin":
        handles = _hook(model, kind, fn)
    runtime.set_plan(plan)
    try:
        got_loss, got_grads = _runtime_step(model, runtime)
    finally:
        runtime.remove()
    assert torch.equal(got_loss, loss) and all(torch.equal(a, b) for a, b in zip(got_grads, grads))


def test_a_noise_hook_on_every_norm_trains_bitwise_under_apply():
    """The case of the report: tiny Qwen3-MoE under `bgl.apply` at 0.75x the capacity one
    micro-batch needs, recompute and offload, a hook adding a term computed from the input on each
    layer's post_attention_layernorm: every micro-batch trains, weights bitwise the plain run's."""
    weights = []
    for plugin in (False, True):
        model = tiny_model("qwen3_moe", num_hidden_layers=3, seed=1)
        _hook(model, "forward", _noise)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        prov = None
        if plugin:
            recipe = tiny_recipe(model, seq_len=16, micro_batch_size=2, capacity=0.75, pipeline={"pp": 1, "micro_batches": 1},
                                 strategies={"allowed": ["recompute", "offload"]})
            prov = bgl.apply(model, recipe)
        try:
            for step in range(3):
                ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if prov is not None:
                # the hook's save is the user's, unknown to the cost model: the first micro-batch keeps it
                # beyond its prediction, and the next ones are planned on it, each layer's where it was kept
                assert all(e.plan for e in prov.events) and [bool(e.misses) for e in prov.events] == [True, False, False]
                assert not prov.calibration.failed and not any(e.spilled_bytes for e in prov.events)
        finally:
            if prov is not None:
                prov.remove()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
