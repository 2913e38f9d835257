"""The launcher, `torchrun -m bagualu_plugin.integrations.nanotron.train --config-file X.yaml`, on
gloo processes: a saved tiny Qwen3-MoE checkpoint (4 MoE layers) trained 2 iterations of 4
micro-batches, stock (`bagualu.enabled: false`, nanotron's own 1F1B engine) and with the
Provisioner under a capacity that forces plans, over PP=2, PP=4 and PP=2 x EP=2. The losses after
optimizer steps (so gradients count too) are bitwise equal; each rank's telemetry shows Algorithm
1's budgets (rank r of pp runs pp - r - 1 warmup forwards); a routing spike on one rank's layers
escalates on that rank only. Gradient reductions are checked against other layouts: EP=2 against
DP=2, and tied embeddings over two pipeline ranks against one process.

Starting the processes (each imports torch, transformers and nanotron) costs more than a tiny
run, so the runs on the same number of processes share one torchrun launch: tests/nanotron_runs.py
calls the launcher's own `main` for each config in turn (the `world1` ... `world8` fixtures);
each run has its 60 s collective timeout and its 300 s, as in a launch of its own."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("nanotron")

from nanotron_configs import STEPS, TINY, M, bagualu_section, load, train_config  # noqa: E402

from bagualu_plugin.adapters import save_tiny, tiny_model  # noqa: E402
from bagualu_plugin.adapters.costs import model_cost  # noqa: E402
from bagualu_plugin.config import RecipeError  # noqa: E402
from bagualu_plugin.integrations.nanotron.compat import import_nanotron  # noqa: E402
from bagualu_plugin.integrations.nanotron.config import Config, recipe_for  # noqa: E402
from bagualu_plugin.integrations.nanotron.train import check_supported  # noqa: E402
from bagualu_plugin.stage import Stage  # noqa: E402

TORCHRUN = Path(sys.executable).with_name("torchrun")
RUNS = Path(__file__).with_name("nanotron_runs.py")
RUN_TIMEOUT_S = 300  # each run's, as each launch's was

def _world(data: dict) -> int:
    par = data["parallelism"]
    return par["pp"] * par["dp"] * par["tp"] * par["expert_parallel_size"]


def _launch(tmp: Path, runs: dict[str, dict]) -> dict[str, dict]:
    """Run the configs, all on one number of processes, in one torchrun launch, one after the
    other (tests/nanotron_runs.py: the launcher's `main` for each); by name, each run's metrics
    lines, each rank's telemetry events and the loaded config."""
    (world,) = {_world(data) for data in runs.values()}
    configs = []
    for name, data in runs.items():
        config, metrics = tmp / f"{name}.yaml", tmp / f"{name}.jsonl"
        data["bagualu"] = {**data["bagualu"], "metrics_path": str(metrics), "telemetry": {"path": str(tmp / f"{name}-events.jsonl")}}
        data["logging"] = {"log_level": "info", "log_level_replica": "info"}  # every rank's figures, through nanotron's logger
        config.write_text(yaml.safe_dump(data))
        configs.append(str(config))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(world), str(RUNS), "--timeout-s", "60",
           "--run-timeout-s", str(RUN_TIMEOUT_S), *configs]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S * len(runs) + 120)  # + the imports
    assert done.returncode == 0, done.stderr[-4000:]
    out = {}
    for name, config in zip(runs, configs):
        events = {}
        for rank in range(world):
            path = tmp / f"{name}-events.rank{rank}.jsonl"
            events[rank] = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        out[name] = {
            "metrics": [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()],
            "events": events,
            "config": import_nanotron().get_config_from_file(config, config_class=Config),
            "log": done.stdout,  # the launch's, every run's lines
        }
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3", **TINY)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    """tie_word_embeddings: the first rank's embedding and the last rank's LM head are one weight."""
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("tied") / "tied", tie_word_embeddings=True, **TINY)


# routing spikes of the PP=2 x EP=2 runs: stage 0's layers, micro-batch 1 of each iteration
SPIKES = {
    "enabled": True, "seed": 3, "spike_probability": 1.0, "normal_max_imbalance": 1.3, "spike_max_imbalance": 2.0,
    "layers": [0, 1], "micro_batches": [1],
}
DUAL = {  # the dual-batch cases: (ep, allowed, capacity)
    "pp4-offload": (1, ["offload"], 3.4),
    "pp4-ep2-recompute": (2, ["recompute"], 2.2),
}
DUAL_M = 6


def _dual_config(checkpoint: Path, case: str, fused: bool) -> dict:
    ep, allowed, capacity = DUAL[case]
    spike = {"enabled": True, "seed": 3, "spike_probability": 1.0, "normal_max_imbalance": 1.3, "spike_max_imbalance": 2.0,
             "layers": [0], "micro_batches": [1, 4]}
    sections = {"strategies": {"allowed": allowed, "offload": {"min_bytes": 0}}, **({"spikes": spike} if ep > 1 else {})}
    return train_config(checkpoint, bagualu_section(4, capacity=capacity, dual_batch=fused, **sections), pp=4, ep=ep, accumulation=DUAL_M)


@pytest.fixture(scope="module")
def configs(checkpoint, tied) -> dict[str, dict]:
    """The config of every successful run of this file's tests, by name."""
    runs = {}
    for pp in (2, 4):
        runs[f"pp{pp}-stock"] = train_config(checkpoint, bagualu_section(pp, enabled=False), pp=pp)
        runs[f"pp{pp}-plugin"] = train_config(checkpoint, bagualu_section(pp), pp=pp)
    runs["spikes-stock"] = train_config(checkpoint, bagualu_section(2, enabled=False, spikes=SPIKES), pp=2, ep=2)
    runs["spikes-plugin"] = train_config(checkpoint, bagualu_section(2, capacity=1.3, spikes=SPIKES), pp=2, ep=2)
    runs["floor-plugin"] = train_config(checkpoint, bagualu_section(2, capacity=0.7, spikes=SPIKES), pp=2, ep=2)
    runs["ep"] = train_config(checkpoint, bagualu_section(2, enabled=False), pp=2, ep=2)
    runs["dp"] = train_config(checkpoint, bagualu_section(2, enabled=False), pp=2, dp=2)
    runs["tied-one"] = train_config(tied, bagualu_section(1, enabled=False), pp=1)
    runs["tied-two"] = train_config(tied, bagualu_section(2, enabled=False), pp=2)
    for case in DUAL:
        for fused in (False, True):
            runs[f"dual-{case}-{fused}"] = _dual_config(checkpoint, case, fused)
    return runs


def _world_runs(world: int, configs: dict[str, dict], tmp_path_factory) -> dict[str, dict]:
    """The runs on `world` processes, in one launch."""
    runs = {name: copy.deepcopy(data) for name, data in configs.items() if _world(data) == world}
    return _launch(tmp_path_factory.mktemp(f"world{world}"), runs)


@pytest.fixture(scope="module")
def world1(configs, tmp_path_factory) -> dict[str, dict]:
    return _world_runs(1, configs, tmp_path_factory)


@pytest.fixture(scope="module")
def world2(configs, tmp_path_factory) -> dict[str, dict]:
    return _world_runs(2, configs, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(configs, tmp_path_factory) -> dict[str, dict]:
    return _world_runs(4, configs, tmp_path_factory)


@pytest.fixture(scope="module")
def world8(configs, tmp_path_factory) -> dict[str, dict]:
    return _world_runs(8, configs, tmp_path_factory)


@pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp4"])
def pipeline(request):
    pp = request.param
    runs = request.getfixturevalue(f"world{pp}")
    return pp, runs[f"pp{pp}-stock"], runs[f"pp{pp}-plugin"]


def _same_losses(stock: dict, plugin: dict, world: int) -> None:
    assert [r["iteration"] for r in stock["metrics"]] == [r["iteration"] for r in plugin["metrics"]] == list(range(STEPS))
    assert [r["loss"] for r in plugin["metrics"]] == [r["loss"] for r in stock["metrics"]]  # floats from JSON: exact
    assert stock["metrics"][0]["loss"] != stock["metrics"][1]["loss"]  # the optimizer stepped
    for ours, theirs in zip(plugin["metrics"], stock["metrics"]):
        assert len(ours["peak_device_bytes"]) == len(theirs["peak_device_bytes"]) == world
        assert all(p > 0 for p in ours["peak_device_bytes"] + theirs["peak_device_bytes"])
        assert ours["peak_device_bytes"][0] < theirs["peak_device_bytes"][0]  # the first rank planned


@pytest.mark.multiprocess
def test_pipeline_losses_are_bitwise_stock_and_the_first_rank_plans(pipeline):
    pp, stock, plugin = pipeline
    _same_losses(stock, plugin, pp)
    assert not any(stock["events"].values())  # no Provisioner, no telemetry
    assert plugin["events"][0][0]["plan"]  # the first rank's first micro-batch has mitigation


@pytest.mark.multiprocess
def test_each_rank_budgets_by_algorithm_1(pipeline, checkpoint):
    pp, _, plugin = pipeline
    model = tiny_model("qwen3_moe", **TINY)
    for rank in range(pp):
        events = plugin["events"][rank]
        assert len(events) == STEPS * M and all(e["live_after_backward"] is not None for e in events)
        recipe = recipe_for(plugin["config"], rank)
        stage = Stage.of(recipe, model_cost(model, recipe.hardware).stage(pp, rank), split=False)
        first = stage.budgets().budget(0)
        for it in range(STEPS):
            ours = events[it * M : (it + 1) * M]
            assert [e["micro_batch"] for e in ours] == list(range(M))
            assert sum(e["phase"] == "warmup" for e in ours) == min(pp - rank - 1, M)  # nanotron's warmup forwards
            assert ours[0]["budget"] == first  # Algorithm 1 starts over each iteration
            assert all(e["actual"] <= e["budget"] for e in ours)


def _world_rank(ep_rank: int, pp_rank: int, pp: int) -> int:
    return ep_rank * pp + pp_rank  # nanotron's layout: ranks = arange(world).reshape(ep, pp, dp, tp), dp = tp = 1


@pytest.mark.multiprocess
def test_expert_parallel_spike_escalates_on_the_hot_rank_only(world4):
    """PP=2 x EP=2: stage 0's layers route up to 1.3x balanced onto expert-parallel rank 0's
    experts, micro-batch 1 of each iteration 1.3-2x (the plans are made for 1.3x); stock sees the
    same routing. Bitwise losses, and only world rank (ep 0, pp 0) escalates, at micro-batch 1."""
    stock, plugin = world4["spikes-stock"], world4["spikes-plugin"]
    _same_losses(stock, plugin, 4)
    escalated = {rank for rank, events in plugin["events"].items() if any(e["escalations"] for e in events)}
    assert escalated == {_world_rank(0, 0, 2)}
    hot = [e for e in plugin["events"][_world_rank(0, 0, 2)] if e["escalations"]]
    assert 1 in {e["micro_batch"] for e in hot} and {x["layer"] for e in hot for x in e["escalations"]} <= {0, 1}
    # each rank logs its figures every iteration through nanotron's logger: the hot rank its escalations
    logged = [line for line in plugin["log"].splitlines() if "bagualu/escalations" in line]
    assert len(logged) >= 4 * STEPS and any("PP=0|TP=0|EXP=0]" in line and "bagualu/escalations: 0 " not in line for line in logged)


@pytest.mark.multiprocess
def test_expert_parallel_floor_runs_on_both_expert_ranks(world4):
    """The same spikes at a capacity where recomputing a layer's experts is not enough: the
    collective escalation (the layer's experts with their all-to-alls) runs on both expert-parallel
    ranks of stage 0 at the same (iteration, micro-batch, layer), the cold one joining; the hot
    rank's own escalations stay its own. Losses bitwise stock: every rank issued the same
    collectives (a rank that did not would have failed the run at the 60 s timeout)."""
    stock, floor = world4["spikes-stock"], world4["floor-plugin"]
    _same_losses(stock, floor, 4)

    def escalations(rank: int, collective: bool) -> set:
        events = enumerate(floor["events"][rank])
        return {(i // M, e["micro_batch"], x["layer"]) for i, e in events for x in e["escalations"] if x["collective"] == collective}

    hot, cold = _world_rank(0, 0, 2), _world_rank(1, 0, 2)
    assert escalations(hot, True) == escalations(cold, True) != set()
    assert escalations(hot, False) and not escalations(cold, False)
    assert not any(e["escalations"] for rank in (_world_rank(0, 1, 2), _world_rank(1, 1, 2)) for e in floor["events"][rank])


@pytest.mark.multiprocess
def test_expert_parallel_gradients_match_data_parallel(world4):
    """The same 2 data replicas as EP=2 (experts sharded, dense gradients averaged over the group,
    expert gradients from the all-to-all's backward) and as DP=2 (everything averaged): the same
    training to float rounding."""
    ep, dp = world4["ep"], world4["dp"]
    for a, b in zip(ep["metrics"], dp["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_tied_embeddings_over_two_stages_match_one_process(world1, world2):
    """tie_word_embeddings: the first rank's embedding and the last rank's LM head are one weight;
    its two gradients are summed, so two pipeline ranks train as one process does."""
    one, two = world1["tied-one"], world2["tied-two"]
    assert one["metrics"][1]["loss"] != one["metrics"][0]["loss"]
    for a, b in zip(one["metrics"], two["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


@pytest.mark.parametrize(
    ("change", "world", "field"),
    [
        ({"tp": 2}, 4, r"parallelism\.tp: tp=2: not supported"),
        ({"dp": 2}, 2, r"parallelism: expert_parallel_size x pp x dp x tp = 4, but torchrun started 2"),
        ({"bagualu": {"enabled": False, "spikes": {"enabled": True}}}, 2, r"bagualu\.spikes\.enabled: .*expert_parallel_size >= 2"),
        ({"zero_stage": 1}, 2, r"optimizer\.zero_stage: zero_stage=1"),
    ],
)
def test_unsupported_configs_are_refused_by_name(tmp_path, change, world, field):
    data = train_config(tmp_path, change.pop("bagualu", {"enabled": False}), **{k: v for k, v in change.items() if k != "zero_stage"})
    if "zero_stage" in change:
        data["optimizer"]["zero_stage"] = change["zero_stage"]
    config = load(tmp_path, data)
    with pytest.raises(RecipeError, match=field):
        check_supported(config, world)


@pytest.mark.multiprocess
def test_a_bad_config_stops_the_launch_before_training_naming_the_field(checkpoint, tmp_path):
    """A capacity below M0, through torchrun: every rank exits with the error, nothing trains."""
    data = train_config(checkpoint, bagualu_section(2, capacity=0.05))
    path, metrics = tmp_path / "bad.yaml", tmp_path / "bad.jsonl"
    data["bagualu"]["metrics_path"] = str(metrics)
    path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "bagualu_plugin.integrations.nanotron.train",
           "--config-file", str(path), "--timeout-s", "60"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and not metrics.exists()
    assert "bagualu.hardware.capacity_bytes: pipeline rank 0" in done.stderr and "M0" in done.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(DUAL))
def test_dual_batch_is_bitwise_the_unfused_schedule(case, request):
    """`bagualu.dual_batch` over 4 pipeline ranks (x 2 expert-parallel ranks, with spikes): the
    fused engine's losses equal the unfused engine's, every rank plans as it does unfused (the
    first rank offloads in one case, recomputes in the other), and rank 0's steady points ran
    fused, y+1 recovered ahead."""
    ep, allowed, _ = DUAL[case]
    m = DUAL_M
    runs = request.getfixturevalue(f"world{4 * ep}")
    unfused, fused = runs[f"dual-{case}-False"], runs[f"dual-{case}-True"]
    assert [r["loss"] for r in fused["metrics"]] == [r["loss"] for r in unfused["metrics"]]
    for rank in range(4 * ep):
        assert [e["plan"] for e in fused["events"][rank]] == [e["plan"] for e in unfused["events"][rank]]
    assert {s for e in unfused["events"][0] for s in e["plan"].values()} == set(allowed)
    points = [e["point"] for e in fused["events"][0] if e["point"]]
    assert len(points) == STEPS * (m - 3) and all(p["recovered"] == p["backward"] + 1 for p in points)
    assert not any(e["point"] for e in unfused["events"][0])
    if ep == 1:  # no spikes: plans repeat with the phase, so the schedules are served from the cache
        assert any(p["cache_hit"] for p in points)
