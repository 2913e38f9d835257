"""What differs between the supported HF MoE families, as one table of named traits.

Every per-family fact lives here, once: the attribute names the adapters look up, how a config's
fields are read into `ModelDims`, and the behaviour the analytic cost model and the runtime
depend on (which tensors a family's modules save, which ops a checkpoint can replay alone). One
code path reads the table for every family (docs/architecture.md); nothing elsewhere compares a
family's name. Pure Python (no torch, no transformers), so the cost model can read it; the tiny
configs, which need transformers, live in `adapters/tiny.py`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTraits:
    model_type: str  # HF config.model_type
    # HF attribute names ---------------------------------------------------------------------
    router: str = "gate"  # attribute of the MoE block holding the router
    shared: tuple[str, ...] = ()  # MoE-block children that form the shared_expert op
    qkv_last: tuple[str, ...] = ("v_proj",)  # the first of these in self_attn is the last projection
    # reading the config into ModelDims ------------------------------------------------------
    num_experts_field: str = "num_experts"
    shared_width: tuple[str, ...] = ()  # config fields whose product is the shared expert's width
    dense_layers_field: str | None = None  # "first_k_dense_replace" (a count) or "mlp_only_layers" (a list)
    rope_table_width: float = 1.0  # RoPE table columns per rotated head column
    mixed_attention_layers: bool = False  # config.layer_types alternates sliding and full attention
    qk_norm: bool = False  # per-head q/k RMSNorms whatever the config says (else config.use_qk_norm)
    norm_topk_prob: bool = False  # renormalises the top-k weights whatever the config says
    mla: bool = False  # multi-head latent attention (low-rank q and kv, decoupled RoPE part)
    bias_field: str = "attention_bias"  # the config flag that gives the projections `biased` a bias
    biased: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # behaviour the cost model and the runtime read ------------------------------------------
    shared_expert_first: bool = False  # the shared expert runs before the router
    shared_expert_gated: bool = False  # the MoE block's forward scales it by sigmoid(shared_expert_gate(x))
    router_fp32: bool = False  # the router upcasts its input and computes in FP32
    routing_weights_fp32: bool = False  # the top-k weights stay FP32 (else the model dtype)
    router_topk_softmax: bool = False  # softmax over the top-k logits only, handed on as the weights
    norm_multiplies_fp32: bool = False  # RMSNorm multiplies its weight in FP32, not the model dtype
    attention_sinks: bool = False  # learned per-head sinks: one more logit column per row
    expert_bias: bool = False  # expert linears and the router have biases, the experts' gathered per pair by expert id
    expert_act_saves: int = 1  # expert-width tensors the expert activation keeps per pair

    @property
    def shared_expert_alone(self) -> bool:
        """Whether a checkpoint of the shared expert's module recomputes exactly the op: not when
        the MoE block's own forward adds glue (the sigmoid gate) that no module computes."""
        return not self.shared_expert_gated


FAMILIES: dict[str, FamilyTraits] = {
    t.model_type: t
    for t in (
        # GLM-4-MoE: sigmoid top-k router in FP32, fused experts, `shared_experts`, dense leading
        # layers; q/k norms (use_qk_norm) run after the three projections
        FamilyTraits(
            "glm4_moe",
            shared=("shared_experts",),
            qkv_last=("k_norm", "v_proj"),
            biased=("q_proj", "k_proj", "v_proj"),
            num_experts_field="n_routed_experts",
            shared_width=("n_shared_experts", "moe_intermediate_size"),
            dense_layers_field="first_k_dense_replace",
            router_fp32=True,
            routing_weights_fp32=True,
        ),
        # DeepSeek-V3: the GLM-4 MoE block with multi-head latent attention; `kv_b_proj` runs last
        FamilyTraits(
            "deepseek_v3",
            shared=("shared_experts",),
            qkv_last=("kv_b_proj",),
            biased=("q_a_proj", "kv_a_proj_with_mqa", "o_proj"),
            num_experts_field="n_routed_experts",
            shared_width=("n_shared_experts", "moe_intermediate_size"),
            dense_layers_field="first_k_dense_replace",
            mla=True,
            router_fp32=True,
            routing_weights_fp32=True,
        ),
        # Qwen2-MoE: softmax router; the shared expert runs before the router and is scaled by
        # sigmoid(`shared_expert_gate`) after the experts
        FamilyTraits(
            "qwen2_moe",
            shared=("shared_expert", "shared_expert_gate"),
            bias_field="qkv_bias",
            biased=("q_proj", "k_proj", "v_proj"),
            shared_width=("shared_expert_intermediate_size",),
            dense_layers_field="mlp_only_layers",
            shared_expert_first=True,
            shared_expert_gated=True,
        ),
        # Qwen3-MoE: softmax router, no shared expert, per-head q/k norms
        FamilyTraits("qwen3_moe", dense_layers_field="mlp_only_layers", qk_norm=True),
        # Mixtral: softmax router with renormalised FP32 weights, coarse-grained experts
        FamilyTraits("mixtral", num_experts_field="num_local_experts", norm_topk_prob=True, routing_weights_fp32=True),
        # gpt-oss: `mlp.router` (with bias) softmaxes the top-k logits; experts have biases and a
        # clamped SwiGLU; attention alternates sliding and full windows and has learned sinks;
        # its rotary embedding returns half-width tables
        FamilyTraits(
            "gpt_oss",
            router="router",
            num_experts_field="num_local_experts",
            rope_table_width=0.5,
            mixed_attention_layers=True,
            router_topk_softmax=True,
            norm_multiplies_fp32=True,
            attention_sinks=True,
            expert_bias=True,
            expert_act_saves=4,
        ),
    )
}


def family_traits(model_type: str | None) -> FamilyTraits:
    """The traits of a supported model_type; an unsupported one is an error listing the supported."""
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]
