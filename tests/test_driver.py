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
