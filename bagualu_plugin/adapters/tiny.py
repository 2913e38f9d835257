"""Tiny random-init models of every supported family, built offline from transformers config
classes, and a character-level tokenizer for them: what tests, examples and benchmarks run on (no
hub downloads anywhere)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from ..families import FAMILIES

# fields shared by every tiny model, by the GLM-4 / DeepSeek-V3 MoE block, by Qwen2/3-MoE, and by
# the two families without dense layers (Mixtral, gpt-oss)
_COMMON = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_experts_per_tok": 2}
_GLM_LIKE = {
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "n_routed_experts": 8,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
}
_QWEN = {
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_experts": 8,
    "mlp_only_layers": [0],
}
_SMALL = {"intermediate_size": 32, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 8}

# model_type -> (transformers config class, fields of its tiny model: hidden 64, 8 experts, top-2,
# a dense first layer where the family has dense layers)
TINY_CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "glm4_moe": (Glm4MoeConfig, {**_GLM_LIKE, "num_key_value_heads": 2, "head_dim": 16}),
    "deepseek_v3": (
        DeepseekV3Config,
        {
            **_GLM_LIKE, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 24,
        },
    ),
    "qwen2_moe": (Qwen2MoeConfig, {**_QWEN, "shared_expert_intermediate_size": 48}),
    "qwen3_moe": (Qwen3MoeConfig, {**_QWEN, "head_dim": 16}),
    "mixtral": (MixtralConfig, _SMALL),
    "gpt_oss": (GptOssConfig, {**_SMALL, "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"]}),
}


def tiny_config(family: str, **overrides):
    """The config of a tiny `family` model (hidden 64, 8 experts, top-2), fields overridable."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; supported: {', '.join(sorted(FAMILIES))}")
    config_class, fields = TINY_CONFIGS[family]
    fields = {**_COMMON, **fields, **overrides}
    if "layer_types" in fields and "layer_types" not in overrides:  # gpt-oss: its pattern, for any layer count
        pattern = fields["layer_types"]
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(fields["num_hidden_layers"])]
    return config_class(**fields)


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


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built offline (no training data): `<unk>` 0, `<eos>` 1, tab,
    newline and printable ASCII, 99 ids, within every tiny model's vocabulary of 128. Save it
    beside a tiny checkpoint (`save_pretrained`) so that `AutoTokenizer` finds one there."""
    chars = ["\t", "\n", *map(chr, range(32, 127))]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<unk>", "<eos>", *chars])}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character a token
    tokenizer.decoder = decoders.Fuse()  # decode without spaces between the characters
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")
