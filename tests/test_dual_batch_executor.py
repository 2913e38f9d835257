"""The fused dual-batch executor (paper §V-B) in the one 1F1B driver: with `dual_batch` each
steady F_x B_y runs interleaved piece by piece, with y+1's recovery ahead of its backward, and
losses, gradients, plans and the bytes each micro-batch keeps equal the unfused schedule's bit for
bit, under plans that recompute and offload."""

import copy
import json

import pytest
import torch
from helpers import collectives, tiny_recipe

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.config import Recipe, RecipeError
from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.runtime.provisioner import apply

M, BATCH, SEQ, PP = 6, 2, 32, 4


def _recipe(model, rank: int, capacity: float, allowed: list[str], telemetry: str | None = None) -> Recipe:
    """Capacity as a multiple of one unmitigated micro-batch; rank 0 of 4 holds 4 in flight."""
    return tiny_recipe(
        model, seq_len=SEQ, micro_batch_size=BATCH, capacity=capacity,
        pipeline={"pp": PP, "rank": rank, "micro_batches": M, "dual_batch": True},
        strategies={"allowed": allowed, "offload": {"min_bytes": 0}}, telemetry=telemetry,
    )


def _fused(recipe: Recipe, fused: bool) -> Recipe:
    return recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"dual_batch": fused})})


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(M)]


def _train(model, recipe: Recipe, fused: bool) -> dict:
    """Two iterations (the second finds the first's schedules in the DP's cache)."""
    prov = apply(model, _fused(recipe, fused))
    calls = {"in backward": 0, "other": 0}  # Linear calls: forwards, and replays in backward or ahead of it

    def count(*_):
        calls["in backward" if torch._C._current_graph_task_id() != -1 else "other"] += 1

    hooks = [m.register_forward_pre_hook(count) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    losses = [loss for _ in range(2) for loss in run_iteration(model, _batches(), prov.stage.schedule, prov)]
    for hook in hooks:
        hook.remove()
    run = {
        "losses": torch.stack(losses),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "plans": [e.plan for e in prov.events],
        "kept": [e.actual for e in prov.events],
        "points": [e.point for e in prov.events],
        "calls": calls,
    }
    prov.remove()
    return run


@pytest.mark.parametrize(
    ("family", "rank", "capacity", "allowed"),
    [
        ("qwen3_moe", 0, 2.6, ["recompute"]),
        ("deepseek_v3", 0, 2.0, ["recompute"]),
        ("glm4_moe", 0, 2.8, ["offload"]),
        ("qwen3_moe", 1, 2.4, ["recompute"]),
    ],
    ids=["qwen3-rank0", "deepseek-rank0", "glm4-rank0", "qwen3-rank1"],
)
def test_fused_points_equal_the_unfused_schedule_bitwise(family, rank, capacity, allowed):
    torch.manual_seed(0)
    base = tiny_model(family, num_hidden_layers=4)
    base.set_experts_implementation("bagualu")
    recipe = _recipe(base, rank, capacity, allowed)
    plain, fused = _train(copy.deepcopy(base), recipe, False), _train(copy.deepcopy(base), recipe, True)
    assert torch.equal(fused["losses"], plain["losses"])
    assert fused["grads"].keys() == plain["grads"].keys()
    assert all(torch.equal(fused["grads"][n], g) for n, g in plain["grads"].items())
    assert fused["plans"] == plain["plans"] and fused["kept"] == plain["kept"]
    assert {s for plan in plain["plans"] for s in plan.values()} == set(allowed)  # the plans mitigate
    # every replay ran once; on rank 0 (x - y = 3) y+1's ran ahead of its backward
    assert sum(fused["calls"].values()) == sum(plain["calls"].values())
    assert (fused["calls"]["in backward"] < plain["calls"]["in backward"]) == (rank == 0 and "recompute" in allowed)

    warmup = PP - rank - 1
    points = [p for p in fused["points"] if p is not None]
    assert len(points) == 2 * (M - warmup) and not any(plain["points"])
    pieces = 4 + 2  # embedding, layers, head
    for x, point in zip(2 * [*range(warmup, M)], points):
        order = point.order
        assert point.backward == x - warmup
        assert [o for o in order if o[0] == "F"] == [f"F{k}" for k in range(pieces)]  # program order within a class
        assert [o for o in order if o[0] == "B"] == [f"B{k}" for k in range(pieces)]
        y = x - warmup
        assert point.recovered == (y + 1 if y + 1 < x - 1 else None)
        assert point.predicted_s <= point.serial_s
    assert any(p.cache_hit for p in points)


def test_each_steady_point_is_in_the_telemetry(tmp_path):
    base = tiny_model("qwen3_moe", num_hidden_layers=4)
    base.set_experts_implementation("bagualu")
    path = tmp_path / "telemetry.jsonl"
    _train(base, _recipe(base, 0, 2.6, ["recompute", "offload"], telemetry=str(path)), True)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["point"] is not None for e in events] == 2 * ([False] * (PP - 1) + [True] * (M - PP + 1))
    assert {"backward", "recovered", "order", "predicted_s", "serial_s", "cache_hit", "solve_s"} <= events[-1]["point"].keys()


def test_a_pipeline_of_two_is_refused_by_name():
    base = tiny_model("qwen3_moe", num_hidden_layers=4)
    with pytest.raises(RecipeError, match=r"pipeline\.dual_batch: .*more than 2 stages.*pp=2"):
        pipeline = {"pp": 2, "micro_batches": 4, "dual_batch": True}
        Recipe.from_dict({**_recipe(base, 0, 2.0, ["recompute"]).model_dump(), "pipeline": pipeline})


def test_overlap_without_fused_points_is_refused_by_name():
    base = tiny_model("qwen3_moe", num_hidden_layers=4)
    with pytest.raises(RecipeError, match=r"pipeline\.overlap_all_to_all: applies to the fused points of dual_batch, which is off"):
        pipeline = {"pp": 4, "micro_batches": 4, "overlap_all_to_all": False}
        Recipe.from_dict({**_recipe(base, 0, 2.0, ["recompute"]).model_dump(), "pipeline": pipeline})


def _expert_parallel_run(rank: int, size: int) -> dict:
    """Fused (its forward's all-to-alls waited on after the work beside them, and at once) against
    unfused on 2 expert-parallel ranks, spikes on micro-batches 1 and 4 (their gates defer and
    escalate; micro-batch 4's layer 2 needs the collective escalation, so both ranks recompute it
    with its all-to-alls), plans that recompute and offload."""
    from bagualu_plugin.adapters import Adapter
    from bagualu_plugin.adapters.gate import RoutingSkew
    from bagualu_plugin.parallel import expert_parallel

    batches = [torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + rank + 10 * i)) for i in range(M)]
    out = {}
    for fused in (False, True, "at once"):
        model = tiny_model("glm4_moe", num_hidden_layers=4)
        model.set_experts_implementation("bagualu")
        expert_parallel(model)
        recipe = _fused(_recipe(model, 0, 1.6, ["recompute", "offload"]), bool(fused))
        pipeline = recipe.pipeline.model_copy(update={"overlap_all_to_all": fused is True} if fused else {})
        recipe = recipe.model_copy(update={
            "parallel": recipe.parallel.model_copy(update={"ep": size, "ep_rank": rank, "dp": size}), "pipeline": pipeline,
        })
        prov = apply(model, recipe)

        def spike(step, model=model):
            fraction = 1.0 if step.micro_batch in (1, 4) else 0.0
            return RoutingSkew(Adapter(model), fraction, ep_size=size, ep_rank=0, layers=[2])

        with collectives() as issued:
            losses = run_iteration(model, batches, prov.stage.schedule, prov, around=spike)
        out[fused] = dict(
            losses=torch.stack(losses),
            grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            plans=[e.plan for e in prov.events],
            escalations=[len(e.escalations) + len(e.deferred) for e in prov.events],
            together={(e.micro_batch, x.layer) for e in prov.events for x in e.escalations if x.collective},
            points=[e.point for e in prov.events if e.point],
            collectives=issued,
        )
        prov.remove()
    return out


@pytest.mark.multiprocess
def test_expert_parallel_ranks_fuse_bitwise_with_spikes():
    hot, cold = ranks = run_ranks(_expert_parallel_run, 2, timeout_s=180)
    moe_layers = 3  # GLM-4-MoE's first layer is dense: each MoE layer's forward dispatches and combines
    for rank in ranks:
        plain = rank[False]
        for fused in (rank[True], rank["at once"]):
            assert torch.equal(fused["losses"], plain["losses"])
            assert all(torch.equal(fused["grads"][n], g) for n, g in plain["grads"].items())
            assert fused["plans"] == plain["plans"] and fused["escalations"] == plain["escalations"]
            assert len(fused["points"]) == M - PP + 1
            assert fused["together"] == plain["together"] == hot[True]["together"] != set()
            assert [p.exchanges for p in fused["points"]] == [2 * moe_layers] * (M - PP + 1)
        # every rank, the same collectives in the same order, and the same work beside the same exchanges
        assert rank[True]["collectives"] == hot[True]["collectives"]
        assert [p.beside for p in rank[True]["points"]] == [p.beside for p in hot[True]["points"]]
        assert all(p.beside and {i[0] for i in p.beside} <= {"B", "R"} for p in rank[True]["points"])
        assert not any(p.beside for p in rank["at once"]["points"])
    assert hot[True]["escalations"][1] + hot[True]["escalations"][4] > 0  # the spikes reached the hot rank's gate
