"""Mixtral: softmax router `mlp.gate`, coarse-grained experts, no shared expert."""

from transformers import MixtralConfig

from .family import Family

FAMILY = Family(
    model_type="mixtral",
    router="gate",
    tiny_config=lambda **kw: MixtralConfig(
        **{
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2, **kw,
        }
    ),
)
