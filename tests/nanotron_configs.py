"""nanotron config dicts for the tests: the sections nanotron 0.4 requires (general, parallelism,
model, tokenizer, tokens) around what a test varies, and loading one with nanotron's own loader
and our `Config`, as the launcher does; `train_config` and `bagualu_section`, the launcher's
runs (tests/test_nanotron_train.py, tests/test_faults.py)."""

from __future__ import annotations

from pathlib import Path

import yaml
from helpers import tiny_recipe

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.integrations.nanotron.compat import import_nanotron
from bagualu_plugin.integrations.nanotron.config import Config

nt_config = import_nanotron()
# the launcher tests' runs: a tiny Qwen3-MoE of LAYERS MoE layers, STEPS iterations of M micro-batches of BATCH x SEQ tokens
M, BATCH, SEQ, STEPS, LAYERS = 4, 2, 16, 2, 4
TINY = {"num_hidden_layers": LAYERS, "mlp_only_layers": []}
_MODEL_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")


def train_config(
    checkpoint: Path, bagualu: dict, pp: int = 2, ep: int = 1, dp: int = 1, tp: int = 1, accumulation: int = M, train_steps: int = STEPS
) -> dict:
    """The launcher's config: the tiny Qwen3-MoE checkpoint at `checkpoint` (saved with TINY), AdamW."""
    hf = tiny_model("qwen3_moe", **TINY).config
    model = {"init_method": {"path": str(checkpoint)}, "model_config": {name: getattr(hf, name) for name in _MODEL_FIELDS}}
    optimizer = {
        "zero_stage": 0, "weight_decay": 0.01, "clip_grad": None, "accumulate_grad_in_fp32": False, "adam_eps": 1e-8,
        "adam_beta1": 0.9, "adam_beta2": 0.95, "torch_adam_is_fused": False,
        "learning_rate_scheduler": {"learning_rate": 1e-3, "lr_warmup_style": "linear"},
    }
    return config_dict(
        model, pp=pp, dp=dp, ep=ep, tp=tp, seq_len=SEQ, micro_batch_size=BATCH, accumulation=accumulation, train_steps=train_steps,
        optimizer=optimizer, bagualu=bagualu,
    )


def bagualu_section(pp: int, enabled: bool = True, capacity: float = 1.6, **sections) -> dict:
    """`capacity` x the first stage's keep-all micro-batch: it holds pp in flight, so it plans.
    The batch and pipeline come from nanotron's own sections."""
    section = tiny_recipe(
        tiny_model("qwen3_moe", **TINY), seq_len=SEQ, micro_batch_size=BATCH, capacity=capacity, stage=(pp, 0),
        strategies={"allowed": ["recompute"]}, batch_section=False, exclude_defaults=True, as_dict=True,
    )
    return {"enabled": enabled, **section, **sections}


def config_dict(
    model: dict, *, pp: int = 1, dp: int = 1, ep: int = 1, tp: int = 1, seq_len: int, micro_batch_size: int,
    accumulation: int, train_steps: int = 1, seed: int = 7, **sections,
) -> dict:
    """`model` is nanotron's model section; `sections` the rest (tokenizer, optimizer, data, bagualu)."""
    return {
        "general": {"project": "test", "seed": seed},
        "parallelism": {"dp": dp, "pp": pp, "tp": tp, "pp_engine": "1f1b", "expert_parallel_size": ep},
        "model": model,
        "tokenizer": {},
        "tokens": {
            "sequence_length": seq_len, "train_steps": train_steps, "micro_batch_size": micro_batch_size,
            "batch_accumulation_per_replica": accumulation,
        },
        **sections,
    }


def load(tmp_path: Path, data: dict, config_class=Config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return nt_config.get_config_from_file(str(path), config_class=config_class)
