"""Qwen2-MoE: softmax router `mlp.gate`; the shared expert runs before the router and is scaled
by sigmoid(`shared_expert_gate`) after the experts."""

from transformers import Qwen2MoeConfig

from .family import Family

FAMILY = Family(
    model_type="qwen2_moe",
    router="gate",
    shared=("shared_expert", "shared_expert_gate"),
    tiny_config=lambda **kw: Qwen2MoeConfig(
        **{
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0], **kw,
        }
    ),
)
