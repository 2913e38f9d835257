"""Recovery ahead of backward (paper §V-B): `PlanRuntime.recover(mb, layer)` prefetches a layer's
host copies and replays its recompute regions before the micro-batch's backward, which then
replays nothing; loss and gradients stay bit for bit what they are without it. The checkpoint
underneath (`runtime.replay`) replays once, as the forward ran (RNG included), and says so when a
replay does not save what its forward saved."""

from collections import Counter

import pytest
import torch

from bagualu_plugin.adapters import Adapter, tiny_model
from bagualu_plugin.costmodel import OpId
from bagualu_plugin.costmodel.plan import Plan
from bagualu_plugin.runtime.plan_runtime import PlanRuntime
from bagualu_plugin.runtime.replay import ReplayError, recording

g = torch.Generator().manual_seed(0)
BATCHES = [torch.randint(0, 128, (2, 32), generator=g) for _ in range(2)]

MODEL = tiny_model("qwen2_moe")  # layer 0 dense, 1 and 2 MoE with the gated shared expert, head 3
LAYER_1 = [OpId(1, name) for name in Adapter(MODEL).layer_ops(Adapter(MODEL).layers[1])]
PLANS = {
    "units": Plan.uniform([OpId(0, "dense_mlp"), OpId(1, "expert_act"), OpId(2, "attn_norm"), OpId(2, "router"), OpId(3, "loss")],
                          "recompute"),
    "layer and MoE block": Plan.uniform([*LAYER_1, *(OpId(2, n) for n in ("router", "expert_fc1", "expert_act", "expert_fc2",
                                                                         "shared_expert"))], "recompute"),
    "spans": Plan.uniform([OpId(1, "attn_core"), OpId(2, "attn_qkv"), OpId(2, "attn_out"), OpId(1, "shared_expert")], "recompute"),
    "offload": Plan.uniform(list(Adapter(MODEL).ops()), "offload"),
    "mixed": Plan({OpId(1, "attn_core"): "offload", OpId(1, "expert_fc1"): "offload", OpId(1, "shared_expert"): "recompute",
                   OpId(2, "expert_act"): "recompute", OpId(2, "attn_out"): "offload"}),
}


def train(plan: Plan, recover: bool):
    """Forward micro-batches 0 and 1, then backward each, recovering every layer of it first (in
    backward order) if `recover`. Module calls are counted per phase: a replay calls the modules
    inside its region again."""
    model = MODEL
    model.zero_grad(set_to_none=True)
    runtime = PlanRuntime(model).install()
    runtime.set_plan(plan)
    a = runtime.adapter
    layers = [a.head_index, *reversed(range(len(a.layers))), -1]
    calls, phase = Counter(), ["forward"]
    handles = [m.register_forward_pre_hook(lambda *_: calls.update([phase[0]])) for m in model.modules()]
    prefetched = []
    try:
        losses = []
        for mb, ids in enumerate(BATCHES):
            runtime.micro_batches.running = mb
            with runtime.forward():
                losses.append(model(input_ids=ids, labels=ids).loss)
        phase[0] = "nothing there"
        runtime.recover(len(BATCHES), 1)  # no such micro-batch
        runtime.recover(0, 99)  # no such layer
        for mb, loss in enumerate(losses):
            if recover:
                phase[0], before = f"R{mb}", runtime.ledger.live_device_bytes
                for layer in layers:
                    runtime.recover(mb, layer)
                prefetched.append(runtime.ledger.live_device_bytes - before)
            phase[0] = f"B{mb}"
            loss.backward()
            phase[0] = f"after B{mb}"  # its backward ran: nothing to recover
            for layer in layers:
                runtime.recover(mb, layer)
    finally:
        for handle in handles:
            handle.remove()
        runtime.remove()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [loss.detach() for loss in losses], grads, calls, prefetched


@pytest.mark.parametrize("name", PLANS)
def test_recover_before_backward_is_exact_and_replays_each_region_once(name):
    losses0, grads0, lazy, _ = train(PLANS[name], recover=False)
    losses, grads, calls, prefetched = train(PLANS[name], recover=True)
    assert all(torch.equal(x, y) for x, y in zip(losses, losses0))
    assert len(grads) == len(grads0) and all(torch.equal(x, y) for x, y in zip(grads, grads0))
    for mb in range(len(BATCHES)):
        assert calls[f"R{mb}"] == lazy[f"B{mb}"]  # each region replayed once, ahead of backward
        assert calls[f"B{mb}"] == 0  # backward replayed nothing
        assert calls[f"after B{mb}"] == lazy[f"after B{mb}"] == 0
    assert calls["nothing there"] == lazy["nothing there"] == 0
    if name == "offload":
        assert all(p > 0 for p in prefetched)  # the copies came back at recover, counted on the device
    else:
        assert all(calls[f"R{mb}"] > 0 for mb in range(len(BATCHES)))


def test_a_frame_dies_with_its_graph():
    runtime = PlanRuntime(MODEL).install()
    runtime.set_plan(PLANS["layer and MoE block"])
    calls = Counter()
    handle = MODEL.model.layers[1].mlp.register_forward_pre_hook(lambda *_: calls.update(["replay"]))
    try:
        with runtime.forward():
            loss = MODEL(input_ids=BATCHES[0], labels=BATCHES[0]).loss
        assert calls["replay"] == 1 and runtime.ledger.live_device_bytes > 0
        del loss  # the graph, and every frame with it
        assert runtime.ledger.live_device_bytes == 0
        runtime.recover(None, 1)
        assert calls["replay"] == 1
    finally:
        handle.remove()
        runtime.remove()


def _dropout_region(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(x.sin(), 0.5).exp()


def _checkpoint(run, *inputs):
    """`run(*inputs)` as a recompute region: its output and its frame."""
    with recording(run, inputs) as frame:
        return run(*inputs), frame


@pytest.mark.parametrize("early", [False, True], ids=["lazy", "recompute_now"])
def test_a_replay_runs_as_the_forward_ran(early):
    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(1)
    _dropout_region(x).sum().backward()
    reference, x.grad = x.grad, None
    torch.manual_seed(1)
    out, frame = _checkpoint(_dropout_region, x)
    state = torch.get_rng_state()
    if early:
        frame.recompute_now()
        assert frame.replayed and torch.equal(torch.get_rng_state(), state)  # the caller's RNG goes on as it was
    out.sum().backward()
    assert frame.replayed and frame.inputs is None
    assert torch.equal(x.grad, reference)


def test_a_replay_that_saves_fewer_tensors_says_so():
    runs = []

    def region(x):
        runs.append(x)
        return x.sin().exp() if len(runs) == 1 else x.sin()

    x = torch.randn(4, requires_grad=True)
    out, frame = _checkpoint(region, x)
    with pytest.raises(ReplayError, match="saved 2 tensors for backward in its forward but 1 in its replay"):
        frame.recompute_now()


def test_a_saved_tensor_is_handed_out_once():
    x = torch.randn(4, requires_grad=True)
    out, _ = _checkpoint(torch.sin, x)
    out.sum().backward(retain_graph=True)
    with pytest.raises(ReplayError, match="unpacked a second time"):
        out.sum().backward()
