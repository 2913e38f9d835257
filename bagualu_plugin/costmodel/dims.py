"""Model dimensions and the parallel layout: the numbers the analytic cost model is built from.

These are also the `model:` and `parallel:` sections of a recipe, so one schema validates both a
YAML file and a direct `CostModel.from_config(ModelDims(...))` call.
"""

from __future__ import annotations

from math import prod
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..families import FAMILIES, FamilyTraits, family_traits
from ..validation import reject

ModelType = Literal[tuple(FAMILIES)]  # a supported HF config.model_type
DType = Literal["bf16", "fp16", "fp32"]
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class MLADims(_Strict):
    """Multi-head latent attention (DeepSeek-V3): low-rank q and kv with a decoupled RoPE part."""

    q_lora_rank: int = Field(ge=0, description="0: q is projected directly from the hidden state")
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)


EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # the fused 3-D expert weights


class LoraDims(_Strict):
    """PEFT LoRA on a frozen base model: only the adapters train. Autograd then keeps a linear's
    input only where an adapter reads it, nothing for the frozen weights themselves, and nothing
    at all before the first adapter (the embedding's output needs no gradient). Targets are named
    as in a decoder layer (`self_attn.q_proj`, `mlp.shared_experts.up_proj`); the fused experts'
    weights (`mlp.experts.gate_up_proj`, `LoraConfig(target_parameters=...)`) and the router's
    (`mlp.gate.weight`) are adapted as one weight each, which the layer then uses in full."""

    rank: int = Field(gt=0)
    ranks: dict[str, int] = Field(
        default_factory=dict,
        description="targets of another rank (PEFT's rank_pattern: twice the rank for a gate_up_proj fused from gate_proj and up_proj)",
    )
    dropout: float = Field(default=0.0, ge=0, lt=1)
    targets: list[str] = Field(min_length=1, description="adapted linears and expert weights, by their names in a decoder layer")
    layers: list[int] | None = Field(default=None, description="decoder layers with adapters (layers_to_transform); None: all")
    dtype: DType = Field(default="fp32", description="the adapters' weights: PEFT keeps them FP32 (autocast_adapter_dtype)")

    def adapts(self, layer: int, target: str) -> bool:
        return target in self.targets and (self.layers is None or layer in self.layers)

    def rank_of(self, target: str) -> int:
        return self.ranks.get(target, self.rank)


class ModelDims(_Strict):
    """A decoder-only MoE transformer as HF transformers builds it (docs/architecture.md)."""

    family: ModelType
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    shared_expert_intermediate_size: int = Field(default=0, ge=0, description="0: no shared expert")
    first_k_dense: int = Field(default=0, ge=0, description="leading layers with a dense MLP")
    dense_intermediate_size: int = Field(default=0, ge=0)
    qk_norm: bool = False
    attention_bias: bool = Field(default=False, description="the family's biased attention projections have a bias")
    norm_topk_prob: bool = Field(default=False, description="top-k routing weights renormalised to sum 1")
    partial_rotary: bool = Field(
        default=False,
        description="RoPE rotates part of each head and cat re-assembles q and k (GLM-4): attention's output "
        "then lands head-major and the context needs its own copy",
    )
    rope_dim: int | None = Field(default=None, gt=0, description="columns of RoPE's cos/sin tables; None: head_dim")
    layer_types: tuple[str, ...] = Field(
        default=(),
        strict=False,  # a YAML list
        description="attention kind per layer where they differ (gpt-oss: sliding / full), each with its own mask",
    )
    mla: MLADims | None = None
    dtype: DType = "bf16"
    attention: Literal["sdpa", "sdpa_masked", "eager"] = Field(
        default="sdpa",
        description="eager keeps the (T x T) probabilities: quadratic memory; sdpa_masked: SDPA given a padding or packing "
        "mask, which it keeps per layer (with repeated keys and values under grouped-query attention)",
    )
    lora: LoraDims | None = Field(default=None, description="PEFT LoRA adapters on the frozen model; None: every weight trains")
    router_dtype: DType | None = Field(
        default=None,
        description="the dtype the routers' weights are stored in where it is not the family's (FP32 for a router that "
        "computes in FP32, else the model's): transformers before 5.2x keep GLM-4-MoE's in the model's dtype; None: "
        "the family's",
    )
    device: Literal["cuda", "cpu"] = Field(
        default="cuda",
        description="where the model trains: CUDA's autocast sums half-precision tensors in FP32 (a renormalising "
        "router keeps an FP32 sum), the CPU's in their dtype; under LoRA CUDA's fused dropout keeps a 1-byte mask, the "
        "CPU's its scaled noise, and on the CPU PEFT makes a 2-D weight's delta (the router's) from FP32 copies of "
        "half-precision factors (`model_cost` reads it off the weights)",
    )
    loss_divisor_bytes: int = Field(
        default=0, ge=0, description="bytes of the caller's token count the loss divides by (the Trainer's num_items_in_batch "
        "tensor), which the loss keeps; 0: none",
    )
    router_aux_loss: Literal["none", "all_tokens", "attention_mask"] = Field(
        default="none",
        description="the load-balancing loss over every MoE layer's router logits (output_router_logits, as TRL asks "
        "for): none, over all tokens, or weighted by a given attention mask",
    )
    autocast: Literal["bf16", "fp16"] | None = Field(
        default=None,
        description="the dtype the forward's autocast computes in (the Trainer's bf16=True or fp16=True, TRL's default "
        "bf16=True), None without autocast: a linear, a matmul or attention on operands of another dtype (FP32 "
        "weights, an FP32 router, PEFT's FP32 adapters) computes on cast copies of them, which it keeps",
    )
    lm_head: Literal["hf", "hf_logits", "trl_fused"] = Field(
        default="hf",
        description="how the LM head and loss run: HF's CausalLM forward, the same given no labels (its logits returned, "
        "no loss: the caller's own loss runs after the forward), or TRL's fused log-prob head (SFTTrainer's "
        "`fused_lm_head`: no logits, its own autograd function)",
    )
    zero3_linear: bool = Field(
        default=False,
        description="F.linear is DeepSpeed ZeRO-3's memory-efficient linear (zero.Init puts it in torch's place), which "
        "keeps its input whenever it makes a graph node: under LoRA a frozen linear's too",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ModelDims:
        checks = [
            (self.top_k > self.num_experts, "top_k", f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})"),
            (
                self.autocast is not None and self.dtype != "fp32" and self.autocast != self.dtype,
                "autocast",
                f"autocast to {self.autocast} over {self.dtype} weights is not modelled; expected {self.dtype} or FP32 weights",
            ),
            (
                self.num_attention_heads % self.num_key_value_heads,
                "num_key_value_heads",
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
            ),
            (
                self.first_k_dense > self.num_layers,
                "first_k_dense",
                f"first_k_dense ({self.first_k_dense}) exceeds num_layers ({self.num_layers})",
            ),
            (
                self.first_k_dense and not self.dense_intermediate_size,
                "dense_intermediate_size",
                "must be > 0 when first_k_dense > 0",
            ),
            (
                self.traits.mla != (self.mla is not None),
                "mla",
                f"mla dimensions are required for families with latent attention "
                f"({', '.join(f for f, t in FAMILIES.items() if t.mla)}) and only for them",
            ),
        ]
        if self.lora is not None:
            known, lora = tuple(lora_shapes(self)), self.lora
            unknown = [t for t in lora.targets if t not in known]
            outside = [i for i in lora.layers or () if i >= self.num_layers]
            stray = [t for t in lora.ranks if t not in lora.targets]
            checks += [
                (unknown, "lora.targets", f"{unknown} are no linears or expert weights of a {self.family} layer: {', '.join(known)}"),
                (outside, "lora.layers", f"{outside} are past the last layer ({self.num_layers - 1})"),
                (stray, "lora.ranks", f"{stray} are not in lora.targets"),
                (any(r <= 0 for r in lora.ranks.values()), "lora.ranks", "ranks must be > 0"),
                (
                    lora.dropout and set(lora.targets) & set(EXPERT_TARGETS),
                    "lora.dropout",
                    "PEFT adapts the fused expert weights (target_parameters) only without dropout",
                ),
            ]
        reject([(path, msg) for bad, path, msg in checks if bad])
        return self

    @property
    def traits(self) -> FamilyTraits:
        return FAMILIES[self.family]

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.first_k_dense, self.num_layers))

    @classmethod
    def from_hf_config(cls, config: Any, dtype: DType | None = None, attention: str | None = None) -> ModelDims:
        """The dimensions of a transformers config of a supported family (attributes read by name,
        so this module needs no transformers import). `dtype` and `attention` default to what the
        config says (`dtype`, `_attn_implementation`)."""
        get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
        traits = family_traits(get("model_type"))
        family = traits.model_type
        heads = get("num_attention_heads")
        dense = get(traits.dense_layers_field) if traits.dense_layers_field else 0
        if isinstance(dense, (list, tuple)):  # the dense layers' indices, which must lead
            only = sorted(dense)
            if only != list(range(len(only))) or get("decoder_sparse_step", 1) != 1:
                raise ValueError(f"{family}: dense layers must lead (mlp_only_layers {only}, decoder_sparse_step 1)")
            dense = len(only)
        mla = None
        if traits.mla:
            mla = MLADims(
                q_lora_rank=get("q_lora_rank") or 0,
                kv_lora_rank=get("kv_lora_rank"),
                qk_nope_head_dim=get("qk_nope_head_dim"),
                qk_rope_head_dim=get("qk_rope_head_dim"),
                v_head_dim=get("v_head_dim"),
            )
        torch_dtype = str(get("dtype") or "float32").removeprefix("torch.")
        rope = get("rope_parameters") or {}
        head_dim = get("head_dim") or get("hidden_size") // heads
        rotary = rope.get("partial_rotary_factor", 1.0)
        rope_dim = mla.qk_rope_head_dim if mla else int(head_dim * rotary * traits.rope_table_width)
        return cls(
            family=family,
            hidden_size=get("hidden_size"),
            num_layers=get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=get("vocab_size"),
            num_experts=get(traits.num_experts_field),
            top_k=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size") or get("intermediate_size"),
            shared_expert_intermediate_size=prod(get(f, 0) for f in traits.shared_width) if traits.shared_width else 0,
            first_k_dense=dense or 0,
            dense_intermediate_size=get("intermediate_size") if dense else 0,
            qk_norm=traits.qk_norm or bool(get("use_qk_norm", False)),
            attention_bias=bool(get(traits.bias_field, False)),
            norm_topk_prob=traits.norm_topk_prob or bool(get("norm_topk_prob", False)),
            partial_rotary=rotary < 1,
            rope_dim=rope_dim if rope_dim != head_dim else None,  # None: head_dim, as a recipe says it
            layer_types=tuple(get("layer_types") or ()) if traits.mixed_attention_layers else (),
            mla=mla,
            dtype=dtype or {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[torch_dtype],
            attention=attention or get("_attn_implementation") or "sdpa",
        )


class Parallel(_Strict):
    """How one device's share is cut: tensor (with sequence) parallel, expert parallel, data parallel."""

    dp: int = Field(default=1, ge=1)
    tp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    ep_rank: int = Field(default=0, ge=0)
    all_to_all: bool | None = Field(
        default=None, description="MoE layers dispatch and combine their rows by all-to-all (real EP); None: when ep > 1"
    )

    @property
    def dispatches(self) -> bool:
        return self.ep > 1 if self.all_to_all is None else self.all_to_all

    @model_validator(mode="after")
    def _rank_in_group(self) -> Parallel:
        reject([("ep_rank", f"ep_rank ({self.ep_rank}) must be < ep ({self.ep})")] if self.ep_rank >= self.ep else [])
        return self


def attention_params(d: ModelDims) -> int:
    """Weights of one attention block (projections, their biases, q/k norms and sinks), without
    its input norm."""
    shapes = lora_shapes(d, moe=False)
    biases = sum(shapes[f"self_attn.{p}"][1] for p in d.traits.biased if f"self_attn.{p}" in shapes) if d.attention_bias else 0
    return _projections(d) + biases + (d.num_attention_heads if d.traits.attention_sinks else 0)


def _projections(d: ModelDims) -> int:
    """The attention projections' weights, with the q/k norms (MLA's low-rank norms included)."""
    h, nh, nkv, hd = d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim
    if d.mla is not None:
        m = d.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * nh * qk if m.q_lora_rank == 0 else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + nh * m.v_head_dim * h
    return h * nh * hd * 2 + h * nkv * hd * 2 + (2 * hd if d.qk_norm else 0)


def lora_shapes(d: ModelDims, moe: bool | None = None) -> dict[str, tuple[int, int, int]]:
    """What PEFT can adapt in a decoder layer of `d` (an MoE or a dense one; None: either), by its
    name there (`LoraDims.targets`), with its (in, out, experts): a rank-r adapter holds
    r (in + out) parameters per expert."""
    h, nh, hd = d.hidden_size, d.num_attention_heads, d.head_dim
    if d.mla is None:
        kv = d.num_key_value_heads * hd
        attention = {"q_proj": (h, nh * hd), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (nh * hd, h)}
    else:
        m = d.mla
        q, rank = nh * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank
        attention = {"q_proj": (h, q)} if rank == 0 else {"q_a_proj": (h, rank), "q_b_proj": (rank, q)}
        attention |= {
            "kv_a_proj_with_mqa": (h, m.kv_lora_rank + m.qk_rope_head_dim),
            "kv_b_proj": (m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim)),
            "o_proj": (nh * m.v_head_dim, h),
        }
    shapes = {f"self_attn.{p}": (i, o, 1) for p, (i, o) in attention.items()}
    mlps = [("mlp", d.dense_intermediate_size)] if d.first_k_dense and moe is not True else []
    if moe is not False:
        shapes[f"mlp.{d.traits.router}.weight"] = (h, d.num_experts, 1)  # PEFT wraps the router's weight as a parameter
        if d.shared_expert_intermediate_size:
            mlps.append((f"mlp.{d.traits.shared[0]}", d.shared_expert_intermediate_size))
            shapes |= {f"mlp.{s}": (h, 1, 1) for s in d.traits.shared[1:]}  # Qwen2-MoE's sigmoid gate
        inter = d.moe_intermediate_size
        shapes |= dict(zip(EXPERT_TARGETS, [(h, 2 * inter, d.num_experts), (inter, h, d.num_experts)]))
    for prefix, width in mlps:
        shapes |= {f"{prefix}.gate_proj": (h, width, 1), f"{prefix}.up_proj": (h, width, 1), f"{prefix}.down_proj": (width, h, 1)}
    return shapes


def adapted(d: ModelDims, layer: int) -> bool:
    """Whether a decoder layer has LoRA adapters (a dense layer has no experts to adapt)."""
    return d.lora is not None and any(d.lora.adapts(layer, t) for t in lora_shapes(d, moe=layer >= d.first_k_dense))


def adapter_params(d: ModelDims, layer: int, targets: tuple[str, ...] | None = None) -> int:
    """Parameters of the LoRA adapters of one decoder layer (those of `targets`; None: all)."""
    if d.lora is None:
        return 0
    shapes = lora_shapes(d, moe=layer >= d.first_k_dense)
    return sum(d.lora.rank_of(t) * (i + o) * e for t, (i, o, e) in shapes.items() if d.lora.adapts(layer, t) and t in (targets or shapes))


def param_count(d: ModelDims, active: bool = False, trainable: bool = False) -> int:
    """Total (or per-token active) parameters, embeddings, an untied LM head and LoRA adapters
    included; `trainable`: those that train (under LoRA only the adapters)."""
    if trainable and d.lora is not None:
        experts = sum(adapter_params(d, i, EXPERT_TARGETS) for i in d.moe_layers)
        routed = experts * d.top_k // d.num_experts if active else experts
        return sum(adapter_params(d, i) for i in range(d.num_layers)) - experts + routed
    h = d.hidden_size
    mlp = 3 * h  # gate, up and down projections per unit of intermediate size
    experts = d.top_k if active else d.num_experts
    moe = mlp * d.moe_intermediate_size * experts + mlp * d.shared_expert_intermediate_size + h * d.num_experts
    moe += h if d.traits.shared_expert_gated else 0  # Qwen2-MoE's sigmoid gate
    moe += experts * (2 * d.moe_intermediate_size + h) + d.num_experts if d.traits.expert_bias else 0
    dense = mlp * d.dense_intermediate_size
    per_layer = attention_params(d) + 2 * h
    n_moe = d.num_layers - d.first_k_dense
    base = d.num_layers * per_layer + n_moe * moe + d.first_k_dense * dense + 2 * d.vocab_size * h + h
    return base + (param_count(d, active, trainable=True) if d.lora is not None else 0)
