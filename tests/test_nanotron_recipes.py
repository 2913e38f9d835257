"""The nanotron configs of recipes/nanotron/: the real-size multi-node ones validate through
`bagualu validate-recipe`; the tiny CPU ones run as they are, after the one command that builds
their checkpoint, through the torchrun launcher (2 gloo processes), and one of them with expert
parallelism on a local text file. A bad nanotron config is an error naming its field, as a bad
recipe is."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bagualu_plugin.cli import main

pytest.importorskip("nanotron")

NANOTRON = Path(__file__).resolve().parents[1] / "recipes" / "nanotron"
REAL = sorted(p for p in NANOTRON.glob("*.yaml") if not p.name.startswith("tiny-"))
TINY = sorted(NANOTRON.glob("tiny-*.yaml"))
QWEN = NANOTRON / "qwen3-30b-a3b-2x8.yaml"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def validate(path, capsys) -> tuple[int, str, str]:
    rc = main(["validate-recipe", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def variant(tmp_path, change, source=QWEN) -> Path:
    """`source` with `change(data)` applied, written to tmp_path."""
    data = yaml.safe_load(source.read_text())
    change(data)
    path = tmp_path / source.name
    path.write_text(yaml.safe_dump(data))
    return path


def test_real_configs_exist():
    assert {p.name for p in REAL} >= {"qwen3-30b-a3b-2x8.yaml", "glm-4.5-air-4x8.yaml"}


@pytest.mark.parametrize("path", REAL, ids=[p.stem for p in REAL])
def test_real_config_validates(path, capsys):
    rc, out, err = validate(path, capsys)
    assert (rc, err) == (0, "")
    assert out.startswith(f"ok: {path} (nanotron config, ")
    data = yaml.safe_load(path.read_text())
    par = data["parallelism"]
    world = par["expert_parallel_size"] * par["pp"] * par["dp"] * par["tp"]
    nodes = int(re.search(r" on (\d+) nodes x 8 ", path.read_text()).group(1))  # the header's layout
    assert f"{world} devices" in out and world == nodes * 8
    assert f"--nnodes {nodes} --nproc_per_node 8" in path.read_text()
    assert data["bagualu"]["metrics_path"] and data["optimizer"]["clip_grad"] is None


@pytest.mark.parametrize("enabled", [False, None], ids=["disabled", "missing"])
def test_nothing_to_validate(tmp_path, capsys, enabled):
    def change(data):
        if enabled is None:
            del data["bagualu"]
        else:
            data["bagualu"]["enabled"] = enabled

    rc, out, err = validate(variant(tmp_path, change), capsys)
    assert (rc, out) == (2, "")
    assert "bagualu.enabled: the bagualu section is missing or disabled" in err


@pytest.mark.parametrize(
    ("section", "key"), [("bagualu", "recompute_everything"), ("parallelism", "bogus"), ("optimizer.learning_rate_scheduler", "warmup")]
)
def test_unknown_key_names_it(tmp_path, capsys, section, key):
    def change(data):
        node = data
        for name in section.split("."):
            node = node[name]
        node[key] = 1

    rc, _, err = validate(variant(tmp_path, change), capsys)
    assert rc == 2
    assert f"{section}.{key}: unknown key" in err


def test_wrong_type_names_the_field(tmp_path, capsys):
    rc, _, err = validate(variant(tmp_path, lambda d: d["tokens"].update(train_steps="many")), capsys)
    assert rc == 2 and "tokens.train_steps" in err


def test_capacity_names_the_rank(tmp_path, capsys):
    """GLM-4.5-Air's layout does not fit an 80 GB H100 (the file's header says why)."""
    glm = NANOTRON / "glm-4.5-air-4x8.yaml"
    rc, _, err = validate(variant(tmp_path, lambda d: d["bagualu"].update(hardware="h100"), glm), capsys)
    assert rc == 2
    assert "bagualu.hardware.capacity_bytes: pipeline rank 0 of " in err and ": capacity " in err


def test_without_nanotron_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nanotron" else real(name, *a))
    monkeypatch.delitem(sys.modules, "bagualu_plugin.integrations.nanotron.config", raising=False)
    rc, _, err = validate(QWEN, capsys)
    assert rc == 2 and "bagualu-plugin[nanotron]" in err
    rc, out, _ = validate("demo", capsys)  # plain recipes do not need it
    assert rc == 0 and out.startswith("ok: demo")


def test_model_config_disagreeing_names_the_field(tmp_path, capsys):
    """model_config copies the checkpoint's config.json (HF names): bagualu compares those it knows."""
    rc, _, err = validate(variant(tmp_path, lambda d: d["model"]["model_config"].update(num_experts=64)), capsys)
    expected = "bagualu recipe model.num_experts=128 disagrees with nanotron model.model_config.num_experts=64"
    assert rc == 2 and f"bagualu.model.num_experts: {expected}" in err


def _checkpoint_command(config: Path) -> re.Match:
    """The header's `bagualu tiny-checkpoint FAMILY DIR --layers N`."""
    return re.search(r"bagualu tiny-checkpoint (\S+) (\S+) --layers (\d+)", config.read_text())


def test_tiny_configs_cover_the_three_families():
    """Their bagualu sections name no model: its dimensions come from the checkpoint."""
    assert {_checkpoint_command(p).group(1) for p in TINY} >= {"glm4_moe", "deepseek_v3", "qwen3_moe"}
    for path in TINY:
        data = yaml.safe_load(path.read_text())
        layers = data["model"]["model_config"]["num_hidden_layers"]
        assert layers % 2 == 0 and layers % 4 == 0 and data["bagualu"]["spikes"]["enabled"] is False
        assert "model" not in data["bagualu"] and _checkpoint_command(path).group(2) == data["model"]["init_method"]["path"]


def _build_checkpoint(tmp_path: Path, config: Path) -> dict:
    """In `tmp_path`, as a user would: the header's tiny-checkpoint command."""
    checkpoint = _checkpoint_command(config)
    cli = [sys.executable, "-m", "bagualu_plugin.cli", "tiny-checkpoint", *checkpoint.groups()[:2], "--layers", checkpoint.group(3)]
    subprocess.run(cli, cwd=tmp_path, env=_ENV, check=True, capture_output=True, timeout=120)
    return yaml.safe_load(config.read_text())


_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}


def _run_tiny(tmp_path: Path, config: Path, nproc: int, data: dict, change=None) -> list[dict]:
    """In `tmp_path`, as a user would, after the header's tiny-checkpoint command (`_build_checkpoint`,
    which gave `data`): the launcher."""
    env = _ENV
    if change is not None:
        change(data)
    (tmp_path / config.name).write_text(yaml.safe_dump(data))
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), "-m", "bagualu_plugin.integrations.nanotron.train",
           "--config-file", config.name, "--timeout-s", "60"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / data["bagualu"]["metrics_path"]).read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", TINY, ids=[p.stem for p in TINY])
def test_tiny_config_runs_as_it_is(tmp_path, path, capsys, monkeypatch):
    data = _build_checkpoint(tmp_path, path)
    monkeypatch.chdir(tmp_path)  # the checkpoint's path is relative to where the user runs
    rc, out, err = validate(path, capsys)
    assert (rc, err) == (0, "") and out.startswith(f"ok: {path} (nanotron config, ")
    metrics = _run_tiny(tmp_path, path, data["parallelism"]["pp"], data)
    assert [m["iteration"] for m in metrics] == list(range(data["tokens"]["train_steps"]))
    capacity = data["bagualu"]["hardware"]["capacity_bytes"]
    assert all(0 < peak <= capacity for m in metrics for peak in m["peak_device_bytes"])
    events = [json.loads(line) for line in (tmp_path / f"{path.stem}-events.rank0.jsonl").read_text().splitlines()]
    assert any(e["plan"] for e in events)  # the first pipeline rank plans


@pytest.mark.multiprocess
def test_tiny_config_with_expert_parallelism_trains_on_a_text_file(tmp_path):
    """PP=2 x EP=2 on 4 processes, a local text file tokenised with the checkpoint's tokenizer: the
    loss falls over the iterations."""
    words = "the quick brown fox jumps over a lazy dog while experts route tokens across ranks".split()
    lines = (" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40)) for i in range(200))
    (tmp_path / "corpus.txt").write_text("\n".join(lines))

    def change(data):
        data["parallelism"]["expert_parallel_size"] = 2
        data["data"] = {"dataset": {"hf_dataset_or_datasets": "corpus.txt", "text_column_name": "text"}, "seed": 7}

    config = NANOTRON / "tiny-glm4-moe.yaml"
    metrics = _run_tiny(tmp_path, config, 4, _build_checkpoint(tmp_path, config), change)
    assert len(metrics[0]["peak_device_bytes"]) == 4
    assert metrics[-1]["loss"] < metrics[0]["loss"]
