"""Qwen3-MoE: softmax router `mlp.gate`, no shared expert, per-head q/k norms."""

from transformers import Qwen3MoeConfig

from .family import Family

FAMILY = Family(
    model_type="qwen3_moe",
    router="gate",
    tiny_config=lambda **kw: Qwen3MoeConfig(
        **{
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0], **kw,
        }
    ),
)
