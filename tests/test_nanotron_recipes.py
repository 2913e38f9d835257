"""The real-size nanotron configs of recipes/nanotron/ validate through `bagualu validate-recipe`,
and a bad nanotron config is an error naming its field, as a bad recipe is."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

from bagualu_plugin.cli import main

pytest.importorskip("nanotron")

NANOTRON = Path(__file__).resolve().parents[1] / "recipes" / "nanotron"
# tiny-*.yaml are CPU configs whose checkpoints are built by their own tests.
REAL = sorted(p for p in NANOTRON.glob("*.yaml") if not p.name.startswith("tiny-"))
QWEN = NANOTRON / "qwen3-30b-a3b-2x8.yaml"


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
    assert "bagualu.hardware.capacity_bytes: pipeline rank 0: capacity" in err


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
