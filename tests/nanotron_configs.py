"""nanotron config dicts for the tests: the sections nanotron 0.4 requires (general, parallelism,
model, tokenizer, tokens) around what a test varies, and loading one with nanotron's own loader
and our `Config`, as the launcher does."""

from __future__ import annotations

from pathlib import Path

import yaml

from bagualu_plugin.integrations.nanotron.compat import import_nanotron
from bagualu_plugin.integrations.nanotron.config import Config

nt_config = import_nanotron()


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
