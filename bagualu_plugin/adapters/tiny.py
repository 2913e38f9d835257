"""Tiny random-init models of every supported family, built offline from transformers config
classes: what tests, examples and benchmarks run on (no hub downloads anywhere)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from .adapter import FAMILIES


def tiny_config(family: str, **overrides):
    """The config of a tiny `family` model (hidden 64, 8 experts, top-2), fields overridable."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[family].tiny_config(**overrides)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random-init tiny causal LM of `family`, deterministic for a seed, in training mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype)
    return model.train()


def save_tiny(family: str, directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny checkpoint with `save_pretrained`; load it back with
    `AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)`."""
    directory = Path(directory)
    tiny_model(family, seed, **overrides).save_pretrained(directory)
    return directory
