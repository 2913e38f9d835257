"""DeepSeek-V3: GLM-like MoE block with multi-head latent attention; `kv_b_proj` runs last."""

from transformers import DeepseekV3Config

from .family import Family

FAMILY = Family(
    model_type="deepseek_v3",
    router="gate",
    shared=("shared_experts",),
    qkv_last=("kv_b_proj",),
    tiny_config=lambda **kw: DeepseekV3Config(
        **{
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 24, **kw,
        }
    ),
)
