"""GLM-4-MoE: sigmoid top-k router `mlp.gate`, fused experts, `shared_experts`, dense leading layers."""

from transformers import Glm4MoeConfig

from .family import Family

FAMILY = Family(
    model_type="glm4_moe",
    router="gate",
    shared=("shared_experts",),
    qkv_last=("k_norm", "v_proj"),  # q/k norms (use_qk_norm) run after the three projections
    tiny_config=lambda **kw: Glm4MoeConfig(
        **{
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "n_group": 1, "topk_group": 1, **kw,
        }
    ),
)
