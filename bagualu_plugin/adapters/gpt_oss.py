"""gpt-oss: the router is `mlp.router` (with bias); experts have biases and transposed weights;
attention alternates sliding and full windows and has learned sinks."""

from transformers import GptOssConfig

from .family import Family

FAMILY = Family(
    model_type="gpt_oss",
    router="router",
    tiny_config=lambda **kw: GptOssConfig(
        **{
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
            "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"], **kw,
        }
    ),
)
