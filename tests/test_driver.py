"""The one 1F1B driver, and what it shows: adaptive provisioning leaves training unchanged over
several optimizer steps, bitwise, against plain training of an identical model."""

import pytest
import torch

from bagualu_plugin import apply
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.adapters.experts import set_expert_parallel
from bagualu_plugin.adapters.gate import RoutingSkew
from bagualu_plugin.config import Recipe
from bagualu_plugin.costmodel import ModelDims
from bagualu_plugin.costmodel.pipeline import one_f_one_b
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.runtime.profiler import profile

PP, RANK, M, BATCH, SEQ, EP, STEPS = 4, 0, 6, 2, 32, 4, 3
SPIKING = {(1, 4), (2, 1)}  # (iteration, micro-batch): all pairs of layer 2 land on this rank


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(M)]


def _skew(model, it):
    """The routing of iteration `it`, in each micro-batch's forward and its backward's recompute;
    the same (no-op) hook elsewhere, so both models run the same code."""

    def around(step):
        fraction = 1.0 if (it, step.micro_batch) in SPIKING else 0.0
        return RoutingSkew(model, fraction, ep_size=EP, ep_rank=0, layers=[2])

    return around


def _train(model, provisioner=None):
    """STEPS iterations through the driver, an AdamW step after each; the losses of each."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for it in range(STEPS):
        losses.append(run_iteration(model, _batches(), one_f_one_b(PP, RANK, M), provisioner, around=_skew(model, it)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("allowed, capacity", [(("recompute", "offload"), 1.6), (("offload",), 1.8)])
def test_adaptive_training_is_bitwise_plain_training(allowed, capacity):
    """Top-2 routing, so the emulated EP rank is exact too (adapters/experts.py); the plain copy
    runs the default HF experts with the same routing skew and no plugin at all. Offload alone:
    the plans offload and the gate still escalates by recomputing the spiking layer's experts."""
    model, plain = tiny_model("glm4_moe", num_hidden_layers=4), tiny_model("glm4_moe", num_hidden_layers=4)
    cm = profile(model, [32, 64, 128], ep_size=EP, ep_rank=0, repeats=1)
    dims = ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa")
    recipe = Recipe.from_dict(
        {
            "hardware": {"preset": "cpu", "capacity_bytes": int(capacity * cm.activation_bytes(BATCH * SEQ, seq_len=SEQ))},
            "model": dims.model_dump(),
            "parallel": {"dp": EP, "ep": EP, "ep_rank": 0},
            "pipeline": {"pp": PP, "rank": RANK, "micro_batches": M},
            "batch": {"seq_len": SEQ, "micro_batch_size": BATCH},
            "budget": {"non_activation_bytes": 0},
            # fp8 is lossy; tensors of a tiny model are all below the default offload minimum
            "strategies": {"allowed": list(allowed), "offload": {"min_bytes": 0}},
        }
    )
    set_expert_parallel(model, EP, 0)
    prov = apply(model, recipe, cm)
    try:
        adaptive = _train(model, prov)
        events = list(prov.events)
        assert len(events) == STEPS * M
        assert all(e.plan for e in events)  # every plan really mitigates, with both strategies
        assert {s for e in events for s in e.plan.values()} <= set(allowed)
        assert any(s == allowed[0] for e in events for s in e.plan.values())
        if allowed == ("offload",):  # its backward's room to bring the copies back is in the budget
            assert all(e.reload_bytes > 0 for e in events)
            assert all(e.actual + e.reload_bytes <= e.budget for e in events if not e.escalations + e.deferred)
        assert any(x.layer == 2 for e in events for x in e.escalations)  # and a spike escalated at its gate
        assert prov.ledger.peak_device_bytes <= recipe.hardware.capacity_bytes
    finally:
        prov.remove()
    reference = _train(plain)
    assert all(torch.equal(a, b) for it_a, it_b in zip(adaptive, reference) for a, b in zip(it_a, it_b))
    assert len(adaptive) == STEPS and adaptive[0][0] != adaptive[-1][0]  # it trained
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_driver_runs_the_schedule_in_order_and_keeps_graphs_until_their_backward():
    model = tiny_model("glm4_moe", num_hidden_layers=2)
    seen = []

    def around(step):
        seen.append(f"{step.kind}{step.micro_batch}")
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    losses = run_iteration(model, _batches()[:3], one_f_one_b(3, 0, 3), around=around)
    assert seen == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert len(losses) == 3 and not any(loss.requires_grad for loss in losses)
    with pytest.raises(ValueError, match=r"without a backward"):
        run_iteration(model, _batches()[:2], one_f_one_b(2, 0, 2)[:-1])
