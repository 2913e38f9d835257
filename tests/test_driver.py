"""The one 1F1B driver: the schedule's order, graphs kept until their backward. (That adaptive
provisioning leaves training bitwise unchanged over several optimizer steps is shown on expert-
parallel ranks, in tests/test_expert_parallel.py.)"""

import pytest
import torch

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.costmodel.pipeline import one_f_one_b
from bagualu_plugin.runtime.driver import run_iteration

M, BATCH, SEQ = 6, 2, 32


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(M)]


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


@pytest.mark.parametrize("fused", [False, True])
def test_an_out_of_memory_error_in_a_planned_forward_leaves_nothing_behind(fused):
    """A device's out-of-memory error (injected: CPU has none) in micro-batch 2's forward, as
    pipeline rank 0 of 4 with 2 micro-batches in flight under a plan (`fused`: through the
    dual-batch executor, micro-batch 4's forward fused with 0's backward): it reaches the caller with
    a note of what the Ledger counted against the capacity; the graphs, hooks, regions and host
    copies are gone, and the next iteration runs, bitwise as a run that never failed. The Ledger's
    simulated out-of-memory error leaves nothing behind either, and keeps its own message."""
    import gc

    from helpers import tiny_recipe

    import bagualu_plugin as bgl
    from bagualu_plugin.runtime import SimulatedOutOfMemoryError

    def recipe(model, capacity):
        return tiny_recipe(
            model, seq_len=SEQ, micro_batch_size=BATCH, capacity=capacity,
            pipeline={"pp": 4, "rank": 0, "micro_batches": M, "dual_batch": fused},
            strategies={"allowed": ["recompute", "offload"], "offload": {"min_bytes": 0}},
        )

    def fail_at(model, mb):
        calls = iter(range(10**6))

        def hook(module, args):
            if next(calls) == mb:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        return model.model.layers[1].register_forward_pre_hook(hook)

    batches = _batches()
    model, plain = tiny_model("glm4_moe", num_hidden_layers=4), tiny_model("glm4_moe", num_hidden_layers=4)
    prov = bgl.apply(model, recipe(model, 2.5))
    hooks = {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()}
    handle = fail_at(model, 4 if fused else 2)
    with pytest.raises(torch.OutOfMemoryError) as failed:
        run_iteration(model, batches, prov.stage.schedule, prov)
    handle.remove()
    note = " ".join(failed.value.__notes__)
    assert "the Ledger counted" in note and "by micro-batch: " in note and " 2: " in note and "against a capacity of" in note, note
    del failed
    gc.collect()
    runtime = prov.runtime
    assert prov.ledger.live_device_bytes == 0 and prov.ledger.live_host_bytes == 0
    assert prov.running_kind is None and not prov.awaits_backward() and not runtime._forwarding
    assert {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()} == hooks
    model.zero_grad(set_to_none=True)
    losses = run_iteration(model, batches, prov.stage.schedule, prov)
    reference = run_iteration(plain, batches, prov.stage.schedule, None)
    assert all(torch.equal(a, b) for a, b in zip(losses, reference))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()) if q.grad is not None)
    assert not list(prov.micro_batches)  # every micro-batch's state went with its backward, the abandoned ones' too
    prov.remove()

    small = tiny_model("glm4_moe", num_hidden_layers=4)
    prov = bgl.apply(small, recipe(small, 2.5))
    prov.ledger.capacity_bytes = prov.ledger.static_bytes + 1  # the simulated device holds nothing
    with pytest.raises(SimulatedOutOfMemoryError) as simulated:
        run_iteration(small, batches, prov.stage.schedule, prov)
    assert not getattr(simulated.value, "__notes__", None) and "capacity" in str(simulated.value)
    del simulated
    gc.collect()
    assert prov.ledger.live_device_bytes == 0 and prov.ledger.live_host_bytes == 0 and not prov.awaits_backward()
    prov.remove()
