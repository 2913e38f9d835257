"""The `bagualu` command: its `main` in this process (its exit status, stdout and stderr), and the
demo, which starts its ranks, as a user runs it."""

import json
import subprocess
import sys

import pytest

from bagualu_plugin.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bagualu_plugin.cli", *args], capture_output=True, text=True)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """`bagualu ARGS` in this process: its exit status, stdout and stderr."""
    try:
        code = main(list(args))
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return code, out, err


def test_curve_on_the_paper_glm_423b_preset(tmp_path, capsys):
    png = tmp_path / "curve.png"
    code, out, err = _main(capsys, "curve", "glm-423b-a30b", "--png", str(png), "--spike", "6:2.6", "--spike", "7:2.6")
    assert code == 0, err
    for op in ("attn_norm", "attn_core", "router", "expert_fc1", "expert_act", "expert_fc2", "shared_expert"):
        assert f"moe.{op}" in out
    assert "recompute" in out and "offload" in out and "fp8" in out
    assert "(interleaved 1F1B, 2 chunks per rank, nothing mitigated)" in out and "layers 0-1, 16-17 of 32 + embedding" in out
    # the paper's layout stacks 23 chunk forwards on rank 0: nothing mitigated, even balanced routing overflows
    assert "balanced routing: 22 warmup F, 42 steady F/B, 22 cooldown B; peak 75.36 GiB" in out
    assert "23 in flight" in out and "OUT OF MEMORY by 11.36 GiB" in out and "OUT OF MEMORY by 20.97 GiB" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_curve_json_is_consistent(tmp_path, capsys):
    code, out, err = _main(capsys, "curve", "glm-423b-a30b", "--png", str(tmp_path / "c.png"), "--json", "--spike", "3:2.6")
    assert code == 0, err
    doc = json.loads(out)
    balanced, spiked = doc["curves"]
    assert doc["capacity_bytes"] == 64 * 2**30
    assert balanced["in_flight_at_peak"] == 23  # rank 0 of 8, 2 chunks: 22 warmup forwards and the first steady one
    chunks = [c["activation_bytes"] for c in doc["chunks"]]
    assert sum(chunks) == pytest.approx(doc["micro_batch"]["activation_bytes"], rel=1e-3)  # each chunk has its RoPE tables
    alive = [0, 0]
    for step in balanced["steps"][: balanced["bytes"].index(balanced["peak_bytes"])]:
        alive[int(step.split(".")[1])] += 1 if step[0] == "F" else -1
    assert sum(alive) == 23 and balanced["peak_bytes"] == pytest.approx(doc["static_bytes"] + alive[0] * chunks[0] + alive[1] * chunks[1])
    assert spiked["peak_bytes"] > balanced["peak_bytes"] and spiked["imbalance"][3] == 2.6
    assert len(balanced["times_s"]) == len(balanced["steps"]) + 1 == 2 * 2 * 32 + 1
    assert {o["name"] for o in doc["ops"]} >= {"expert_fc1", "embed"}
    assert set(doc["ops"][0]["mitigation"]) == {"recompute", "offload", "fp8"}


def test_validate_recipe(tmp_path, capsys):
    assert main(["validate-recipe", "glm-423b-a30b", "qwen3_moe"]) == 0
    assert "ok: glm-423b-a30b" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("hardware: h100\nmodel: {family: glm4_moe}\n")
    assert main(["validate-recipe", str(bad), "qwen3_moe"]) == 2  # every file is checked
    out, err = capsys.readouterr()
    assert "ok: qwen3_moe" in out
    lines = err.splitlines()
    assert f"bagualu validate-recipe: error: recipe {bad}: model.hidden_size" in err and "pipeline" in err
    assert len(lines) > 1 and all(line.startswith("bagualu validate-recipe: error: recipe ") for line in lines)


@pytest.mark.parametrize(
    "args, message",
    [
        (["curve", "glm-423b-a30b", "--spike", "seven"], "MICRO_BATCH:IMBALANCE"),  # argparse's
        (["curve", "glm-423b-a30b", "--spike", "99:2"], "--spike micro-batch 99"),  # the subcommand's, after parsing
        (["curve", "no-such-recipe"], "built-in recipes"),  # the recipe's
        (["simulate", "glm-423b-a30b", "--seed", "-1"], "--seed"),
        (["simulate", "glm-423b-a30b", "--trace", "x.jsonl", "--seed", "1"], "--trace"),
        (["demo", "--policies", "adaptive,greedy"], "--policies expects distinct names"),
        (["demo", "--policies", "none,none"], "--policies expects distinct names"),
        (["demo", "--steps", "0"], "--steps must be >= 1"),
        (["demo", "no-such-recipe"], "no-such-recipe"),
        (["report", "."], "no bagualu-telemetry.jsonl (or bagualu-telemetry.rank<R>.jsonl) in this directory"),
        (["report", "missing.jsonl"], "missing.jsonl: no such telemetry file or output directory"),
    ],
)
def test_every_error_reads_as_argparse_writes_its_own(args, message, capsys):
    """`bagualu <command>: error: ...` on stderr, naming what is wrong, exit status 2, wherever
    the error was found (the demo's before any process starts)."""
    code, _, err = _main(capsys, *args)
    assert code == 2 and message in err
    assert err.splitlines()[-1].startswith(f"bagualu {args[0]}: error: ")


@pytest.mark.multiprocess
def test_demo_writes_table_timeline_and_json(tmp_path):
    png, out = tmp_path / "timeline.png", tmp_path / "demo.json"
    done = _run("demo", "--steps", "2", "--policies", "adaptive,none,unbounded,oracle", "--png", str(png), "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert all(f"vs {p}" in done.stdout for p in ("full recompute", "oracle", "unbounded")) and "planner ms/mb" in done.stdout
    assert "EP rank 0 of 4 processes" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(out.read_text())["policies"]
    assert [r["policy"] for r in rows] == ["adaptive", "none", "unbounded", "oracle"]
    for r in rows:
        assert {"policy", "steps_completed", "ooms", "tokens_per_s", "peak_device_bytes", "capacity_bytes"} <= set(r)
        assert r["steps_completed"] + r["ooms"] == 2
        assert r["rank"] == 0 and len(r["rank_peak_device_bytes"]) == 4
    assert rows[0]["ooms"] == 0 and rows[0]["peak_device_bytes"] <= rows[0]["capacity_bytes"]
    adaptive, none, unbounded, oracle = rows
    # no capacity: the unmitigated run that crashed under it completes, over it
    assert none["ooms"] == 1 and unbounded["ooms"] == 0 and unbounded["peak_device_bytes"] > unbounded["capacity_bytes"]
    assert unbounded["vs_unbounded"] == 1.0 and 0 < adaptive["vs_unbounded"] and adaptive["vs_full_recompute"] is None
    assert oracle["ooms"] == 0 and oracle["vs_oracle"] == 1.0 and adaptive["vs_oracle"] > 0


def test_demo_fails_before_training_when_capacity_cannot_hold_m0(tmp_path, capsys):
    import re

    from bagualu_plugin.config import builtin_recipes

    recipe = tmp_path / "small.yaml"
    recipe.write_text(re.sub(r"capacity_bytes: \w+", "capacity_bytes: 2MB", builtin_recipes()["demo"].read_text()))
    code, _, err = _main(capsys, "demo", str(recipe), "--steps", "1", "--png", str(tmp_path / "t.png"))
    assert code == 2 and f"bagualu demo: error: {recipe}: " in err
    assert "cannot hold static memory 0 plus 4 in-flight micro-batches" in err and "M0 = " in err
    assert not (tmp_path / "t.png").exists()


def test_curve_judges_headroom_against_the_usable_capacity(tmp_path, capsys):
    """Capacity less budget.reserve_bytes: 64 GiB less 6 GiB, against the 75.36 GiB peak."""
    from bagualu_plugin.config import builtin_recipes

    recipe = tmp_path / "reserved.yaml"
    recipe.write_text(builtin_recipes()["glm-423b-a30b"].read_text() + "\nbudget: {reserve_bytes: 6GiB}\n")
    assert main(["curve", str(recipe), "--png", str(tmp_path / "c.png"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["capacity_bytes"] == 58 * 2**30
    assert doc["curves"][0]["peak_bytes"] > 58 * 2**30 and not doc["curves"][0]["fits"]
    assert main(["curve", str(recipe), "--png", str(tmp_path / "c.png")]) == 0
    assert "balanced routing: 22 warmup F" in (out := capsys.readouterr().out) and "OUT OF MEMORY by 17.36 GiB" in out


def test_tiny_checkpoint_writes_a_model_and_a_tokenizer(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path / "tiny"
    assert main(["tiny-checkpoint", "gpt_oss", str(directory), "--layers", "3", "--seed", "1"]) == 0
    assert f"wrote {directory}: a tiny gpt_oss checkpoint (3 layers, vocab 128, seed 1)" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert model.config.num_hidden_layers == 3 and model.config.layer_types[2] == "sliding_attention"
    ids = tokenizer("Hi there!\n", add_special_tokens=False)["input_ids"]
    assert max(ids + [tokenizer.eos_token_id]) < model.config.vocab_size and tokenizer.decode(ids) == "Hi there!\n"
    bad = ((["nope", "d"], "argument FAMILY: invalid choice: 'nope'"), (["mixtral", "d", "--layers", "0"], "--layers must be >= 1"))
    for args, message in bad:
        with pytest.raises(SystemExit):
            main(["tiny-checkpoint", *args])
        assert message in capsys.readouterr().err


def test_report_names_a_line_that_is_no_event_and_an_empty_run(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "other.jsonl").write_text('{"loss": 1.0}\n')
    code, _, err = _main(capsys, "report", str(tmp_path / "empty.jsonl"))
    assert code == 2 and "empty.jsonl: no micro-batch ended its backward in this run" in err
    code, _, err = _main(capsys, "report", str(tmp_path / "other.jsonl"))
    assert code == 2 and "other.jsonl:1: not a telemetry event" in err
