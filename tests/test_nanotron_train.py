"""The launcher, `torchrun -m bagualu_plugin.integrations.nanotron.train --config-file X.yaml`,
on 2 gloo processes: a tiny Qwen3-MoE checkpoint trained 2 iterations of 3
micro-batches over 2 pipeline ranks, stock (`bagualu.enabled: false`) and with the Provisioner
under a capacity that forces plans on the first rank. Both write a metrics line per iteration; the
losses (after an optimizer step, so gradients count too) are bitwise equal, the plugin's peaks lower."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("nanotron")

from bagualu_plugin.adapters import save_tiny, tiny_model  # noqa: E402
from bagualu_plugin.adapters.costs import model_cost  # noqa: E402
from bagualu_plugin.config import RecipeError  # noqa: E402
from bagualu_plugin.costmodel import ModelDims  # noqa: E402
from bagualu_plugin.integrations.nanotron.config import Config  # noqa: E402
from bagualu_plugin.integrations.nanotron.train import check_supported  # noqa: E402

PP, M, BATCH, SEQ, STEPS = 2, 3, 2, 16, 2
TORCHRUN = Path(sys.executable).with_name("torchrun")
_NANOTRON_MODEL_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")


def _config(checkpoint: Path, bagualu: dict | None = None, **parallelism) -> dict:
    hf = tiny_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[]).config
    data = {
        "general": {"project": "test", "seed": 7},
        "parallelism": {"dp": 1, "pp": PP, "tp": 1, "pp_engine": "1f1b", "expert_parallel_size": 1, **parallelism},
        "model": {
            "init_method": {"path": str(checkpoint)},
            "model_config": {name: getattr(hf, name) for name in _NANOTRON_MODEL_FIELDS},
        },
        "tokenizer": {},
        "tokens": {"sequence_length": SEQ, "train_steps": STEPS, "micro_batch_size": BATCH, "batch_accumulation_per_replica": M},
        "optimizer": {
            "zero_stage": 0, "weight_decay": 0.01, "clip_grad": None, "accumulate_grad_in_fp32": False, "adam_eps": 1e-8,
            "adam_beta1": 0.9, "adam_beta2": 0.95, "torch_adam_is_fused": False,
            "learning_rate_scheduler": {"learning_rate": 1e-3, "lr_warmup_style": "linear"},
        },
    }
    if bagualu is not None:
        data["bagualu"] = bagualu
    return data


def _bagualu() -> dict:
    """Enabled, with 1.6x the first stage's keep-all micro-batch: it holds PP in flight, so it plans."""
    model = tiny_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[])
    keep = model_cost(model).stage(PP, 0).activation_bytes(BATCH * SEQ, seq_len=SEQ)
    return {
        "enabled": True,
        "hardware": {"preset": "cpu", "capacity_bytes": int(1.6 * keep)},
        # without defaults: the empty tuples of a dump do not survive YAML
        "model": ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa").model_dump(exclude_defaults=True),
        "budget": {"non_activation_bytes": 0},
        "strategies": {"allowed": ["recompute"]},
    }


def _launch(tmp: Path, name: str, data: dict) -> list[dict]:
    config, metrics = tmp / f"{name}.yaml", tmp / f"{name}.jsonl"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(PP), "-m", "bagualu_plugin.integrations.nanotron.train",
           "--config-file", str(config), "--metrics", str(metrics), "--timeout-s", "60"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    checkpoint = save_tiny("qwen3_moe", tmp / "ckpt", num_hidden_layers=4, mlp_only_layers=[])
    stock = _launch(tmp, "stock", _config(checkpoint, {"enabled": False}))
    plugin = _launch(tmp, "plugin", _config(checkpoint, _bagualu()))
    return stock, plugin


def test_stock_and_plugin_write_a_line_per_iteration_with_bitwise_equal_losses(runs):
    stock, plugin = runs
    assert [r["iteration"] for r in stock] == [r["iteration"] for r in plugin] == list(range(STEPS))
    assert [r["loss"] for r in plugin] == [r["loss"] for r in stock]  # floats from JSON: exact
    assert stock[0]["loss"] != stock[1]["loss"]  # the optimizer stepped
    for ours, theirs in zip(plugin, stock):
        assert len(ours["peak_device_bytes"]) == len(theirs["peak_device_bytes"]) == PP
        assert all(p > 0 for p in ours["peak_device_bytes"] + theirs["peak_device_bytes"])
        assert ours["peak_device_bytes"][0] < theirs["peak_device_bytes"][0]  # the first rank planned


@pytest.mark.parametrize(
    ("parallelism", "field"),
    [({"dp": 2}, "parallelism.dp"), ({"tp": 2}, "parallelism.tp"), ({"expert_parallel_size": 2}, "parallelism.expert_parallel_size")],
)
def test_unsupported_parallelism_is_refused_by_name(tmp_path, parallelism, field):
    from bagualu_plugin.integrations.nanotron.compat import import_nanotron

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, **parallelism)))
    config = import_nanotron().get_config_from_file(str(path), config_class=Config)
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        check_supported(config, PP)
