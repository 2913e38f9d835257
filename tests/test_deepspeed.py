"""DeepSpeed ZeRO over 2 gloo processes on CPU (DeepSpeed's CPU accelerator, `deepspeed.initialize`;
the Trainer does not run DeepSpeed on CPU: `tests/test_engines.py`). ZeRO-3 gathers each module's
parameters into new storages in its forward pre-hooks, with every parameter partitioned
(`stage3_param_persistence_threshold: 0`): the Ledger never counts them, so each micro-batch
keeps what its cost model says (no miss), and under a capacity that forces plans the losses and
the final weights are bitwise those of the same engine without the plugin. The plugin installed
before `deepspeed.initialize` (the engine's hooks come later) and after it. Needs DeepSpeed, which
PyPI ships as source only: `.ci/run` builds it (`pip install --no-build-isolation deepspeed`)."""

from __future__ import annotations

import os

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from helpers import run_jobs, tiny_recipe  # noqa: E402

import bagualu_plugin as bgl  # noqa: E402
from bagualu_plugin.adapters import tiny_model  # noqa: E402

pytestmark = pytest.mark.multiprocess
SEQ, MBS, STEPS = 16, 2, 3


def _train(rank: int, size: int, stage: int, plugin: str) -> dict:
    """`STEPS` ZeRO steps of a tiny Qwen3-MoE; `plugin`: "none", "before" or "after" `initialize`."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(size))  # as a launcher sets them
    deepspeed.init_distributed(dist_backend="gloo")  # on the ranks' group
    config = {
        "train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "train_batch_size": MBS * size,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    recipe = tiny_recipe(model, seq_len=SEQ, micro_batch_size=MBS, capacity=0.7, parallel={"dp": size},
                         pipeline={"pp": 1, "micro_batches": 1}, strategies={"allowed": ["recompute", "offload"]})
    prov = bgl.apply(model, recipe) if plugin == "before" else None
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    if plugin == "after":
        prov = bgl.apply(model, recipe)
    ids = torch.randint(0, 128, (MBS, SEQ), generator=torch.Generator().manual_seed(100 + rank))
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=ids, labels=ids.clone()).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    out = {"losses": losses, "weights": weights}
    if prov is not None:
        out.update(
            misses=[m for e in prov.events for m in e.misses], planned=sum(bool(e.plan) for e in prov.events),
            peak=prov.peak_device_bytes, capacity=prov.stage.capacity, events=len(prov.events),
        )
        prov.remove()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    jobs = {f"{stage}-{plugin}": (_train, stage, plugin) for stage in (2, 3) for plugin in ("none", "before", "after")}
    return run_jobs(2, jobs, timeout_s=120)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("plugin", ["before", "after"])
def test_zero_trains_bitwise_under_plans_with_the_ledger_on_the_cost_model(runs, stage, plugin):
    for ours, stock in zip(runs[f"{stage}-{plugin}"], runs[f"{stage}-none"]):
        assert ours["losses"] == stock["losses"]
        assert all(torch.equal(ours["weights"][k], stock["weights"][k]) for k in stock["weights"])
        assert ours["events"] == STEPS and ours["planned"] == STEPS  # the capacity forced a plan on each
        assert ours["misses"] == [] and ours["peak"] <= ours["capacity"]
