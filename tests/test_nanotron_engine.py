"""nanotron's real 1F1B engine, `PipelineBlock`s and P2P over gloo processes, with and without the
Provisioner (`integrations.nanotron.engine`): a tiny HF Qwen3-MoE cut into pipeline stages
(`integrations.nanotron.model`) trains one batch of 4 micro-batches on 2 and 4 pipeline ranks.
Under a capacity that forces plans on the first ranks, losses and gradients equal the stock
engine's bitwise, and each rank's Provisioner sees nanotron's warmup count and in-flight
micro-batches. Every group has a 60 s collective timeout (`parallel.launch`); the runs on 2 ranks
share one launch, those on 4 another (`helpers.run_jobs`)."""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("nanotron")

from helpers import run_jobs, tiny_recipe  # noqa: E402

import bagualu_plugin as bgl  # noqa: E402
from bagualu_plugin.adapters import tiny_model  # noqa: E402
from bagualu_plugin.adapters.costs import model_cost  # noqa: E402
from bagualu_plugin.adapters.gate import GateMonitor  # noqa: E402
from bagualu_plugin.config import Recipe  # noqa: E402
from bagualu_plugin.costmodel import OpId  # noqa: E402
from bagualu_plugin.runtime.ledger import Ledger  # noqa: E402
from bagualu_plugin.runtime.plan_runtime import apply_plan  # noqa: E402

M, BATCH, SEQ = 4, 2, 16

pytestmark = pytest.mark.multiprocess  # every test runs gloo ranks (`run_ranks`)


def _model():
    model = tiny_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[])
    model.set_experts_implementation("bagualu")
    return model


def _recipe(model, pp: int, rank: int, capacity: int) -> Recipe:
    """Capacity in bytes."""
    return tiny_recipe(
        model, seq_len=SEQ, micro_batch_size=BATCH, capacity_bytes=capacity, pipeline={"pp": pp, "rank": rank, "micro_batches": M},
        strategies={"allowed": ["recompute"]},
    )


def _train(rank: int, size: int, plugin: bool, capacity: float = 1.6, head: dict | None = None) -> dict:
    """One batch through nanotron's engine: stock, or with the Provisioner (`capacity` x the
    stage's keep-all micro-batch); `head`: a plan the stock run's stages follow (`apply_plan`)."""
    from bagualu_plugin.integrations.nanotron.compat import import_pipeline

    import_pipeline()  # PyPI's nanotron 0.4 imports only so
    from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine
    from nanotron.parallel.pipeline_parallel.p2p import P2P
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    from bagualu_plugin.integrations.nanotron.engine import BagualuPipelineEngine
    from bagualu_plugin.integrations.nanotron.model import PipelineModel

    model, last = _model(), size - 1
    p2p = P2P(dist.group.WORLD, device=torch.device("cpu"))
    stages = PipelineModel(model, p2p)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(M)]
    batch = [
        {"input_ids": x if rank == 0 else TensorPointer(0), "labels": x.clone() if rank == last else TensorPointer(last)} for x in data
    ]
    out = {}
    if plugin:
        cost = model_cost(model).stage(size, rank)
        keep = cost.activation_bytes(BATCH * SEQ, seq_len=SEQ)
        prov = bgl.apply(model, _recipe(model, size, rank, int(capacity * keep)), cost)  # rank r holds size - r in flight
        engine = BagualuPipelineEngine(prov, BATCH * SEQ, SEQ)
        pairs = []  # every gate's local pairs, in order: a micro-batch's forward runs its MoE layers in turn
        gates = GateMonitor(model, on_gate=lambda layer, _, local: pairs.append(int(local))).install()
    else:
        engine = OneForwardOneBackwardPipelineEngine()
    try:
        # the saved bytes: the Provisioner's Ledger, or one tracking the stock run (under `head`'s plan)
        ledger = prov.ledger if plugin else Ledger.for_model(model)
        with nullcontext() if plugin else apply_plan(model, head, ledger=ledger) if head else ledger.track():
            outputs = engine.train_batch_iter(model=stages, pg=p2p.pg, batch=batch, nb_microbatches=M, grad_accumulator=None)
        out["peak"] = ledger.peak_device_bytes
    finally:
        if plugin:
            events = list(prov.events)
            prov.remove()
            gates.remove()
    if plugin:
        per = len(cost.moe_layers)
        out["exact"] = [  # what each micro-batch kept, and the stage's cost model at its real routing and plan
            (e.actual, cost.activation_bytes(BATCH * SEQ, pairs[i * per : (i + 1) * per], SEQ, _plan(e.plan)))
            for i, e in enumerate(events)
        ]
        out["phases"] = {e.micro_batch: e.phase for e in events}
        out["planned"] = sum(bool(e.plan) for e in events)
        out["plans"] = [e.plan for e in events]
        out["fits"] = all(e.actual <= e.budget for e in events)
    out["losses"] = [o["loss"].detach() for o in outputs] if rank == last else []
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out


def _plan(plan: dict[str, str]) -> dict:
    return {OpId(int(op.split(".")[0]), op.split(".")[1]): strategy for op, strategy in plan.items()}


HEAD = {OpId(4, "lm_head"): "recompute", OpId(4, "loss"): "recompute"}  # 4 layers: the head is block 4


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list]:
    """The runs on 2 pipeline ranks, in one launch: `_train`'s results by run, in rank order."""
    return run_jobs(2, {
        "plugin": (_train, True),  # at 1.6 x the stage's keep-all micro-batch
        "stock": (_train, False),
        "plugin, ample capacity": (_train, True, 100.0),
        "stock, head recomputed": (_train, False, 1.6, HEAD),
    }, timeout_s=60)


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list]:
    return run_jobs(4, {"plugin": (_train, True), "stock": (_train, False)}, timeout_s=60)


@pytest.mark.parametrize("size", [2, 4])
def test_the_provisioner_inside_nanotron_s_engine_is_bitwise_stock(size, request):
    runs = request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[size])
    plugin, stock = runs["plugin"], runs["stock"]
    for rank, (ours, theirs) in enumerate(zip(plugin, stock)):
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
        assert ours["grads"].keys() == theirs["grads"].keys() and ours["grads"]
        assert all(torch.equal(g, theirs["grads"][n]) for n, g in ours["grads"].items())
        warmup = size - rank - 1  # nanotron's warmup forwards on this rank, which the Provisioner checked
        assert [p for _, p in sorted(ours["phases"].items())] == ["warmup"] * warmup + ["steady"] * (M - warmup)
        assert ours["fits"]
    assert len(stock[-1]["losses"]) == M
    assert plugin[0]["planned"] > 0  # the first rank holds the most micro-batches: it had to plan


def test_each_stage_keeps_what_its_cost_model_says_to_the_byte(two_ranks):
    """Every rank's micro-batches, kept whole (ample capacity) or planned (1.6 x), at their real
    routing: a stage's saved tensors (its RoPE tables shared by its layers, as HF shares them)
    are the cost model's stage, to the byte."""
    for run in ("plugin, ample capacity", "plugin"):
        for rank in two_ranks[run]:
            assert rank["exact"] and all(actual == predicted for actual, predicted in rank["exact"])


def test_the_last_stage_recomputes_its_head_through_the_loss_runner(two_ranks):
    """The head block runs the LM head and loss through the runtime's loss runner, so a plan that
    recomputes them (the head's `LOSS_OPS` unit) holds on a pipeline's last stage: less kept, the
    same losses and gradients bitwise."""
    kept, recomputed = two_ranks["stock"], two_ranks["stock, head recomputed"]
    assert all(torch.equal(a, b) for a, b in zip(kept[1]["losses"], recomputed[1]["losses"]))
    for ours, theirs in zip(recomputed, kept):
        assert all(torch.equal(g, theirs["grads"][n]) for n, g in ours["grads"].items())
    assert recomputed[1]["peak"] < kept[1]["peak"] and recomputed[0]["peak"] == kept[0]["peak"]
