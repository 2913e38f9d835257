"""benchmarks/gpu_payoff.py --cpu: the GPU one-shot's steps, small, on the CPU, one process (the
expert-parallel peers are emulated in it). Every part prints its table and writes its numbers;
the policies behave as the paper says at a capacity that cannot hold a 2.6x spike unmitigated."""

import contextlib
import importlib
import io
import json
from pathlib import Path

import pytest
import torch

from bagualu_plugin.demo import POLICIES

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One `--cpu` run for every test here: the module, its JSON and what it printed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # it imports benchmarks/overhead.py by module name, as a script does
        bench = importlib.import_module("gpu_payoff")
        out = tmp_path_factory.mktemp("payoff") / "payoff.json"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert bench.main(["--cpu", "--json", str(out)]) == 0
    return bench, json.loads(out.read_text()), printed.getvalue()


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("gpu_payoff")


def test_every_policy_runs_and_only_adaptive_provisioning_survives_the_spike_fast(cpu_run):
    bench, doc, _ = cpu_run
    part = doc["payoff"]
    rows = {r["policy"]: r for r in part["policies"]}
    assert list(rows) == [*POLICIES, "hf_checkpointing", "torch_sac"]  # TRL's offloading needs an accelerator
    assert list(part["skipped"]) == ["trl_offloading"] and part["skipped"]["trl_offloading"].startswith("not run")
    assert part["iterations"] >= bench.MIN_ITERATIONS
    spike_it = bench.FORCED_SPIKE[0]
    assert part["spikes"][str(spike_it)] == pytest.approx(2.6)
    capacity = part["activation_capacity"]
    cal = part["calibration"]
    assert cal["normal"] < capacity < cal["spike"]  # the normal band fits unmitigated, a 2.6x spike does not
    adaptive, none, oracle, unbounded = (rows[p] for p in ("adaptive", "none", "oracle", "unbounded"))
    assert none["ooms"] >= 1 and spike_it in none["oom_iterations"] and none["steps_completed"] == part["iterations"] - none["ooms"]
    assert rows["static_average"]["ooms"] >= 1
    for policy in ("adaptive", "oracle", "full_recompute", "static_worst", "unbounded", "hf_checkpointing", "torch_sac"):
        assert rows[policy]["ooms"] == 0 and rows[policy]["steps_completed"] == part["iterations"], policy
    assert adaptive["peak_device_bytes"] <= capacity and oracle["peak_device_bytes"] <= capacity
    assert unbounded["peak_device_bytes"] > capacity  # it kept the spike: nothing enforced
    assert rows["full_recompute"]["peak_device_bytes"] < adaptive["peak_device_bytes"]
    # whole layers recomputed keep their inputs only; the selective policy keeps more, far less than nothing recomputed
    assert rows["hf_checkpointing"]["peak_device_bytes"] < rows["torch_sac"]["peak_device_bytes"] < capacity / 2
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and len(r["iteration_s"]) == r["steps_completed"]
    # the one miss: the emulated skew's index, in the first micro-batch (see the module's docstring)
    assert adaptive["missed_forwards"] == oracle["missed_forwards"] == 1
    assert adaptive["vs_oracle"] > 0 and adaptive["vs_unbounded"] > 0 and adaptive["planner_ms_per_micro_batch"] > 0
    # a restart is charged: the crashed policies run far slower than any that did not crash
    assert none["tokens_per_s"] < min(rows[p]["tokens_per_s"] for p in ("adaptive", "full_recompute", "unbounded"))


def test_tax_dual_batch_and_time_error_parts(cpu_run):
    _, doc, _ = cpu_run
    tax = doc["tax"]
    assert tax["mitigated_micro_batches"] == 0  # ample capacity: every plan empty
    assert tax["ratio_min"] <= tax["ratio"] <= tax["ratio_max"] and tax["ratio"] > 0
    assert len(tax["times"]["plugin"]) == len(tax["times"]["plain"]) == tax["iterations"]

    dual = doc["dual_batch"]
    assert dual["strategies"] == ["offload"] and dual["fused_points"] > 0 and dual["predicted_point"] > 0
    assert [s["schedule"] for s in dual["schedules"]] == ["unfused 1F1B", "fused dual-batch"]
    for s in dual["schedules"]:
        assert s["overlap"] is None and len(s["iteration_s"]) == dual["iterations"] - 1 and min(s["iteration_s"]) > 0
    assert len(dual["ratios"]) == dual["iterations"] - 1

    error = doc["time_error"]
    rows = {r["op"]: r for r in error["rows"]}
    for op in ("attn_core", "router", "dispatch", "expert_fc1", "expert_act", "expert_fc2", "combine", "lm_head", "total"):
        assert rows[op]["measured_forward_s"] > 0, op
    for kind in ("forward", "backward"):
        parts = sum(r[f"measured_{kind}_s"] for op, r in rows.items() if op != "total")
        assert rows["total"][f"measured_{kind}_s"] == pytest.approx(parts)
        assert rows["expert_fc1"][f"analytic_{kind}_s"] > 0 and rows["expert_fc1"][f"profiled_{kind}_s"] > 0
    assert not torch.distributed.is_initialized()  # the emulated group is gone


def test_cpu_mode_prints_one_table_per_part_and_says_what_it_cannot_measure(cpu_run):
    _, _, printed = cpu_run
    assert "the other 3 emulated mirrors" in printed  # the emulation is labelled
    titles = [line for line in printed.splitlines() if line[:3] in ("1. ", "2. ", "3. ", "4. ")]
    assert [t[:2] for t in titles] == ["1.", "2.", "3.", "4."]
    assert printed.count("\n---") >= 4  # a table under each
    assert "SimulatedOutOfMemoryError" in printed and "perf_counter" in printed
    assert "trl_offloading: not run: TRL's OffloadActivations needs an accelerator" in printed
    assert printed.count("not measurable on CPU (no streams)") == 2  # copies under compute need CUDA streams


def test_arguments_are_checked_by_name(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--cpu", "--iterations", "1"])
    assert "--iterations must be >= 2" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.main([])
        assert "--cpu" in capsys.readouterr().err



def test_mirrors_send_this_rank_what_it_sends_itself(bench):
    """The emulated peers: an all-to-all brings this rank's chunk to itself from every rank (cut,
    or padded with zeros, to the size expected), a sum counts it once per rank."""
    with bench.mirrored(4):
        counts = torch.arange(8)
        received = torch.empty_like(counts)
        torch.distributed.all_to_all_single(received, counts)
        assert received.tolist() == [0, 1] * 4
        rows = torch.arange(7.0)  # this rank sends 3 rows to itself, 1, 2 and 1 to the others
        back = torch.full((10,), -1.0)
        torch.distributed.all_to_all_single(back, rows, [3, 2, 4, 1], [3, 1, 2, 1])
        assert back.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 0, 0]
        total = torch.tensor([1.5])
        torch.distributed.all_reduce(total)
        top = torch.tensor([2.0])
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
        assert total.item() == 6.0 and top.item() == 2.0 and torch.distributed.get_world_size() == 4
    assert not torch.distributed.is_initialized()


def test_copy_overlap_counts_side_stream_copies_under_any_kernel(bench):
    """The trace arithmetic of part 3, which only a GPU feeds: copies on streams without kernels
    (the host pool's), covered by the union of the kernels on any stream."""
    def event(cat, name, ts, dur, stream):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [
        event("kernel", "gemm", 0, 10, 7), event("kernel", "gemm", 5, 10, 8), event("kernel", "gemm", 30, 10, 7),
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 10, 30, 20),  # under [10, 15] and [30, 40]
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 16, 2, 7),  # on a compute stream: a host sync, not an offload
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 10, 21),  # under nothing
        event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 40, 22),  # not between device and host
    ]
    found = bench.copy_overlap(events)
    assert found["copies"] == 2 and found["copy_ms"] == pytest.approx(0.04) and found["hidden"] == pytest.approx(15 / 40)
    assert bench.copy_overlap(events[:3])["hidden"] is None  # no copies


def test_selective_checkpointing_charges_exactly_what_its_cache_keeps(bench):
    """torch_sac: the outputs torch's cache keeps (no saved-tensor hook sees them) are charged to
    the Ledger until the region recomputes; the gradients are those of the plain function."""
    import alternatives
    from torch.utils.checkpoint import checkpoint

    from bagualu_plugin.runtime.ledger import Ledger

    w1, w2 = (torch.randn(16, 16, requires_grad=True) for _ in range(2))
    x = torch.randn(8, 16, requires_grad=True)

    def region(x):  # three matmuls: the first and third saved, the relu and the second recomputed
        return (((x @ w1).relu() @ w2) @ w1).sum(-1)

    ledger = Ledger()
    with ledger.track():
        y = checkpoint(region, x, use_reentrant=False, context_fn=alternatives.sac_contexts(lambda: ledger))
    kept = ledger.live_device_bytes
    assert kept == 2 * 8 * 16 * 4 + 8 * 16 * 4  # two saved matmul outputs, and the region's input
    y.sum().backward()
    grads = [t.grad.clone() for t in (x, w1, w2)]
    assert ledger.live_device_bytes == 0
    for t in (x, w1, w2):
        t.grad = None
    region(x).sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (x, w1, w2)))


def test_an_alternative_that_fails_ends_its_own_row(bench, monkeypatch):
    """Another library's error (not running out of memory) ends that alternative alone: its text is
    kept for the table, what it installed is taken back, and later iterations skip it."""
    import alternatives

    from bagualu_plugin.demo.model import rank_batches, rank_model
    from bagualu_plugin.stage import Stage

    with bench.mirrored(bench.EP):
        recipe = bench.make_recipe(bench.CPU, 1 << 50)
        batches, stage = rank_batches(recipe, 0), Stage.of(recipe, split=False)
        schedule = [[dict.fromkeys(stage.cost.moe_layers, 1.0) for _ in batches]] * 2
        run = alternatives.AlternativeRun("hf_checkpointing", stage, schedule, batches, rank_model(recipe.model).state_dict(), hot=0)
        layers = [m for m in run.model.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and all(m.gradient_checkpointing for m in layers)

        def broken():
            raise RuntimeError("a library's own bug")

        monkeypatch.setattr(run, "_forward", broken)
        run.iteration(0)
        run.iteration(1)
        assert run.error == "RuntimeError: a library's own bug" and run.result.steps_completed == 0
        assert not any(m.gradient_checkpointing for m in layers) and run.runner is None
