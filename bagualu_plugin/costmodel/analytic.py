"""Operator graphs from model dimensions, for models far too large to run here (paper §IV-A).

Each block lists, operator by operator, the storages that HF transformers' modules save for
backward (DESIGN.md section 5: RMSNorm upcasts to FP32 and keeps the upcast and its reciprocal
norm, linears keep their input, SiLU-gating keeps both halves, the `grouped_mm` experts keep the
gathered tokens and index vectors, sdpa keeps q, k, v, its output and log-sum-exp). Casts that are
no-ops in FP32 share the input's storage, so an FP32 model saves fewer distinct tensors.

Times follow the roofline of one device: each load coefficient costs the larger of its FLOPs over
peak FLOP/s and its bytes over HBM bandwidth, plus a launch per kernel; backward costs twice the
forward. Tensor parallelism is Megatron-style with sequence parallelism: every per-token term of
attention, norms and dense MLPs is divided by tp; experts are split by expert parallelism only.
"""

from __future__ import annotations

from dataclasses import replace

from ..hardware import HardwareSpec
from .dims import DTYPE_BYTES, ModelDims, Parallel, attention_params
from .graph import INPUT, BlockGraph, OpSpec, TensorSpec, standard_spans, standard_units
from .linear import LinearForm

_F32, _I64, _I32 = 4, 8, 4


class _Block:
    """Accumulates ops and tensors of one block; savers are added as ops are declared."""

    def __init__(self, kind: str, dims: ModelDims, par: Parallel, hw: HardwareSpec):
        self.kind, self.dims, self.par, self.hw = kind, dims, par, hw
        self.b = DTYPE_BYTES[dims.dtype]
        self.ops: list[OpSpec] = []
        self.tensors: dict[str, dict] = {}
        self.dense_params = self.expert_params = 0

    # load units: per token of the micro-batch (split by tp), per routed pair, per score pair
    def tok(self, x: float) -> LinearForm:
        return LinearForm(per_token=x / self.par.tp)

    def pair(self, x: float) -> LinearForm:
        return LinearForm(per_routed=x)

    def score(self, x: float) -> LinearForm:
        return LinearForm(per_score=x / self.par.tp)

    def tensor(
        self,
        name: str,
        producer: str,
        elements: LinearForm,
        dtype_bytes: int,
        floating: bool = True,
        shared: bool = False,
        held_by: tuple[int, ...] = (),
    ) -> str:
        self.tensors[name] = dict(
            producer=producer, savers=[], elements=elements, dtype_bytes=dtype_bytes, floating=floating, shared=shared,
            held_by=held_by,
        )
        return name

    def save(self, op: str, *names: str) -> None:
        for n in names:
            if op not in self.tensors[n]["savers"]:
                self.tensors[n]["savers"].append(op)

    def op(self, name: str, inputs: tuple[str, ...], flops: LinearForm, traffic: LinearForm, kernels: int) -> None:
        """Forward time per load unit: max(FLOPs / peak, bytes / HBM bandwidth); backward 2x."""
        hw = self.hw

        def unit(f: float, m: float) -> float:
            return max(f / hw.peak_flops, m / hw.hbm_bandwidth)

        fwd = LinearForm(
            unit(flops.const, traffic.const) + kernels * hw.kernel_launch_s,
            unit(flops.per_token, traffic.per_token),
            unit(flops.per_routed, traffic.per_routed),
            unit(flops.per_score, traffic.per_score),
        )
        self.ops.append(OpSpec(name, inputs, fwd, fwd * 2))

    def comm(self, name: str, inputs: tuple[str, ...], bytes_per_pair: float) -> None:
        """An expert-parallel all-to-all: the rows this rank's experts receive (per routed pair,
        what a skewed rank waits for) over the link between the group's devices, plus the
        count exchange; backward sends the gradients the other way."""
        hw, ep = self.hw, self.par.ep
        link = hw.intra_node_bandwidth if ep <= hw.devices_per_node else hw.inter_node_bandwidth
        fwd = LinearForm(const=3 * hw.kernel_launch_s, per_routed=bytes_per_pair / link)
        self.ops.append(OpSpec(name, inputs, fwd, fwd))

    def build(self) -> BlockGraph:
        tensors = tuple(
            TensorSpec(
                n, t["producer"], tuple(t["savers"]), t["elements"], t["dtype_bytes"], t["floating"], t["shared"], t["held_by"]
            )
            for n, t in self.tensors.items()
        )
        ops = tuple(op.name for op in self.ops)
        units = standard_units(self.kind, ops, shared_alone=self.dims.traits.shared_expert_alone)
        spans = standard_spans(self.kind, ops)
        return BlockGraph(self.kind, tuple(self.ops), tensors, self.dense_params, self.expert_params, units, spans)

    # building pieces shared by several ops ------------------------------------------------
    def rmsnorm(self, prefix: str, producer: str, inp: str, width: int, groups: int = 1) -> list[str]:
        """HF RMSNorm over `groups` vectors per token: upcast to FP32 (a no-op in FP32, which then
        keeps `inp` itself), keep the upcast, 1/rms, and the normalised input for the weight
        multiply: cast back to the model dtype first, except in gpt-oss, which multiplies in FP32.
        Returns the saved tensors."""
        normed = _F32 if self.dims.traits.norm_multiplies_fp32 else self.b
        saved = [inp] if self.b == _F32 else [self.tensor(f"{prefix}.x32", producer, self.tok(width), _F32)]
        saved.append(self.tensor(f"{prefix}.rstd", producer, self.tok(groups), _F32))
        saved.append(self.tensor(f"{prefix}.normed", producer, self.tok(width), normed))
        return saved

    def gated_mlp(self, op: str, inp: str, inter: int, width: int) -> None:
        """down(silu(gate(x)) * up(x)): keeps x, gate, silu(gate), up and their product."""
        saved = [inp] + [self.tensor(f"{op}.{n}", op, self.tok(inter), self.b) for n in ("gate", "silu", "up", "prod")]
        self.save(op, *saved)
        self.dense_params += 3 * width * inter // self.par.tp


def _norm_op(blk: _Block, op: str, inp: str, out: str) -> None:
    h = blk.dims.hidden_size
    blk.save(op, *blk.rmsnorm(op, op, inp, h))
    blk.tensor(out, op, blk.tok(h), blk.b)
    blk.op(op, (inp,), blk.tok(4 * h), blk.tok((2 * blk.b + 2 * _F32) * h), kernels=6)
    blk.dense_params += h


def _attention(blk: _Block, inp: str) -> str:
    """attn_norm, attn_qkv, attn_core, attn_out; returns the residual stream after attention.

    attn_qkv ends with the last projection, so RoPE belongs to attn_core (DESIGN.md section 4),
    which keeps the rotated q and k, a contiguous v, and either the kernel's output and
    log-sum-exp (sdpa) or the (heads x L x L) probabilities (eager). The context handed to the
    output projection is the kernel's output itself, except where q and k were re-assembled with
    cat (partial rotary, MLA): then the output lands head-major and the context is a copy.
    """
    d, b = blk.dims, blk.b
    h, nh, nkv, hd = d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim
    _norm_op(blk, "attn_norm", inp, "attn_norm.out")
    blk.save("attn_qkv", "attn_norm.out")
    if d.mla is None:
        q_w, k_w, v_w, ctx_w = nh * hd, nkv * hd, nkv * hd, nh * hd
        if d.qk_norm:  # per-head RMSNorm on q and k after their projections
            for name, w in (("q", q_w), ("k", k_w)):
                raw = blk.tensor(f"attn_qkv.{name}_raw", "attn_qkv", blk.tok(w), b)
                blk.save("attn_qkv", *blk.rmsnorm(f"attn_qkv.{name}_norm", "attn_qkv", raw, w, groups=w // hd))
        proj_flops = 2 * h * (q_w + k_w + v_w)
        core_q, core_k = "attn_core", "attn_core"  # RoPE makes them inside attn_core
    else:
        m = d.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q_w, k_w, v_w, ctx_w = nh * qk, nh * qk, nh * m.v_head_dim, nh * m.v_head_dim
        lora = [("q_a", m.q_lora_rank, m.q_lora_rank), ("kv_a", m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim)]
        for name, rank, raw_width in lora:
            if rank:  # the low-rank latent is RMS-normalised before its up-projection
                raw = blk.tensor(f"attn_qkv.{name}_out", "attn_qkv", blk.tok(raw_width), b)
                blk.save("attn_qkv", *blk.rmsnorm(f"attn_qkv.{name}_norm", "attn_qkv", raw, rank))
                blk.save("attn_qkv", blk.tensor(f"attn_qkv.{name}_normed_out", "attn_qkv", blk.tok(rank), b))
        q_flops = 2 * h * q_w if m.q_lora_rank == 0 else 2 * m.q_lora_rank * (h + q_w)
        kv_flops = 2 * h * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
        proj_flops = q_flops + kv_flops
        # q is assembled with cat before kv_b_proj; k after it (in attn_core); v is a view of
        # kv_b_proj's output, which a fused kernel keeps whole (nope and v columns)
        blk.tensor("attn_qkv.kv_b_out", "attn_qkv", blk.tok(nh * (m.qk_nope_head_dim + m.v_head_dim)), b)
        core_q, core_k = "attn_qkv", "attn_core"
    for name in ("q_in", "k_in", "v_in"):  # what the projections hand to attention's core
        blk.tensor(name, "attn_qkv", blk.tok({"q_in": q_w, "k_in": k_w, "v_in": v_w}[name]), b)
    blk.op(
        "attn_qkv",
        ("attn_norm.out",),
        blk.tok(proj_flops),
        LinearForm(const=attention_params(d) * b / blk.par.tp) + blk.tok((h + 2 * (q_w + k_w + v_w)) * b),
        kernels=12,
    )

    sinks = d.traits.attention_sinks  # learned per-head sinks add one logit column, max-subtracted
    repeat = d.mla is None and nkv != nh and d.attention == "eager"  # repeat_kv copies k, v per query head
    blk.save("attn_core", blk.tensor("attn_core.q", core_q, blk.tok(q_w), b))
    blk.save("attn_core", blk.tensor("attn_core.k", core_k, blk.tok(nh * hd if repeat else k_w), b))
    if d.mla is not None and d.attention == "sdpa":
        blk.save("attn_core", "attn_qkv.kv_b_out")
    else:  # a contiguous v; eager MLA keeps the whole key/value projection for one sequence
        v = blk.tok(nh * hd if repeat else v_w)
        if d.mla is not None:
            v += LinearForm(per_single_token=nh * d.mla.qk_nope_head_dim / blk.par.tp)
        blk.save("attn_core", blk.tensor("attn_core.v", "attn_core", v, b))
    copy_ctx = d.partial_rotary or d.mla is not None
    if d.attention == "sdpa":
        blk.save("attn_core", blk.tensor("attn_core.lse", "attn_core", blk.tok(nh), _F32))
        if copy_ctx:
            blk.save("attn_core", blk.tensor("attn_core.out", "attn_core", blk.tok(ctx_w), b))
    elif sinks:  # softmax in the model dtype over L + 1 columns, after subtracting the row max
        blk.save("attn_core", blk.tensor("attn_core.probs", "attn_core", blk.score(nh) + blk.tok(nh), b))
        blk.save("attn_core", blk.tensor("attn_core.max_index", "attn_core", blk.tok(nh), _I64, floating=False))
    else:  # softmax in FP32, cast back to the model dtype for the product with v
        blk.save("attn_core", blk.tensor("attn_core.probs32", "attn_core", blk.score(nh), _F32))
        if b != _F32:
            blk.save("attn_core", blk.tensor("attn_core.probs", "attn_core", blk.score(nh), b))
    blk.tensor("ctx", "attn_core", blk.tok(ctx_w), b)
    blk.save("attn_core" if d.attention == "sdpa" and not copy_ctx else "attn_out", "ctx")
    blk.save("attn_out", "ctx")
    qk_dim = q_w // nh
    blk.op(
        "attn_core",
        ("q_in", "k_in", "v_in"),
        blk.score(nh * (qk_dim + ctx_w // nh)),  # 2 FLOPs x 2 matmuls, halved by the causal mask
        blk.tok((q_w + k_w + v_w + 2 * ctx_w) * b) + (blk.score(nh * 2 * _F32) if d.attention == "eager" else LinearForm()),
        kernels=4 if d.attention == "sdpa" else 8,
    )

    blk.tensor("attn_out.residual", "attn_out", blk.tok(h), b)
    weights = LinearForm(const=ctx_w * h * b / blk.par.tp)
    blk.op("attn_out", ("ctx",), blk.tok(2 * ctx_w * h), weights + blk.tok((ctx_w + 2 * h) * b), kernels=2)
    blk.dense_params += attention_params(d) // blk.par.tp
    return "attn_out.residual"


def _router(blk: _Block, h_in: str) -> str:
    """The router's saved tensors; returns the routing weights it hands to the experts.

    GLM-4 and DeepSeek-V3 route in FP32 through a sigmoid (keeping an FP32 copy of a low-precision
    input); Qwen and Mixtral through an FP32 softmax; gpt-oss softmaxes only the top-k logits.
    All keep the top-k index; renormalised weights keep the raw top-k and their sum. The weights
    stay FP32 except where Qwen and gpt-oss cast them to the model dtype; gpt-oss hands on the very
    softmax output it keeps.
    """
    d, b = blk.dims, blk.b
    h, E, k = d.hidden_size, d.num_experts, d.top_k
    blk.save("router", blk.tensor("router.x32", "router", blk.tok(h), _F32) if d.traits.router_fp32 and b != _F32 else h_in)
    if d.traits.router_topk_softmax:
        blk.save("router", blk.tensor("router.topk_softmax", "router", blk.tok(k), b))
    else:
        blk.save("router", blk.tensor("router.scores", "router", blk.tok(E), _F32))
    blk.save("router", blk.tensor("router.topk_index", "router", blk.tok(k), _I64, floating=False))
    if d.norm_topk_prob:
        blk.save("router", blk.tensor("router.topk_raw", "router", blk.tok(k), _F32))
        blk.save("router", blk.tensor("router.topk_sum", "router", blk.tok(1), _F32))
    blk.op("router", (h_in,), blk.tok(2 * h * E), LinearForm(const=E * h * _F32) + blk.tok(h * b + 3 * E * _F32), kernels=10)
    blk.expert_params += E * h
    if d.traits.router_topk_softmax:
        return "router.topk_softmax"
    return blk.tensor("topk_weights", "router", blk.tok(k), _F32 if d.traits.routing_weights_fp32 else b)


def _moe(blk: _Block, h_in: str) -> None:
    """router, expert_fc1, expert_act, expert_fc2 (the "bagualu" experts: grouped_mm split in
    three), shared_expert."""
    d, b = blk.dims, blk.b
    h, E, inter = d.hidden_size, d.num_experts, d.moe_intermediate_size
    local = E // blk.par.ep
    shared = d.shared_expert_intermediate_size > 0
    if shared and d.traits.shared_expert_first:
        _shared_expert(blk, h_in)
    weights = _router(blk, h_in)
    bias = d.traits.expert_bias
    width = blk.tensors[weights]["dtype_bytes"]
    rows, index = h_in, "router.topk_index"
    if blk.par.dispatches:
        rows, index, weights = _dispatch(blk, h_in, weights, width)

    offsets = blk.tensor("experts.offsets", "expert_fc1", LinearForm(const=local), _I32, floating=False)
    blk.save("expert_fc1", offsets, blk.tensor("expert_fc1.token_index", "expert_fc1", blk.pair(1), _I64, floating=False))
    ids = blk.tensor("expert_fc1.expert_ids", "expert_fc1", blk.pair(1), _I64, floating=False)
    if bias:  # per-pair bias rows are gathered by expert id, in fc1 and again in fc2
        blk.save("expert_fc1", ids)
        blk.save("expert_fc2", ids)
    blk.save("expert_fc1", blk.tensor("expert_fc1.x", "expert_fc1", blk.pair(h), b))
    blk.tensor("fc1_out", "expert_fc1", blk.pair(2 * inter), b)
    perm = blk.tensor("expert_fc1.pair_perm", "expert_fc1", blk.pair(1), _I64, floating=False)
    blk.op(
        "expert_fc1",
        (rows, index),  # without EP, the index the router returns is the one it keeps
        blk.pair(2 * h * 2 * inter),
        LinearForm(const=local * 2 * inter * h * b) + blk.pair((2 * h + 2 * inter) * b),
        kernels=6,
    )

    # SiLU gating keeps silu(gate); gpt-oss's clamped SwiGLU keeps four I-wide intermediates
    blk.save("expert_act", "fc1_out")
    for i in range(d.traits.expert_act_saves):
        blk.save("expert_act", blk.tensor(f"expert_act.t{i}", "expert_act", blk.pair(inter), b))
    blk.tensor("act_out", "expert_act", blk.pair(inter), b)
    blk.op("expert_act", ("fc1_out",), blk.pair(5 * inter), blk.pair(4 * inter * b), kernels=2)

    blk.save("expert_fc2", offsets, perm, "act_out")
    blk.save("expert_fc2", blk.tensor("expert_fc2.inverse_perm", "expert_fc2", blk.pair(1), _I64, floating=False))
    blk.save("expert_fc2", blk.tensor("expert_fc2.weights", "expert_fc2", blk.pair(1), width))
    blk.save("expert_fc2", blk.tensor("expert_fc2.y", "expert_fc2", blk.pair(h), b))
    blk.op(
        "expert_fc2",
        ("act_out", ids, perm, offsets, weights),
        blk.pair(2 * inter * h + h),
        LinearForm(const=local * inter * h * b) + blk.pair((inter + 3 * h) * b),
        kernels=5,
    )
    blk.expert_params += local * 3 * h * inter
    if blk.par.dispatches:  # the weighted rows back, in the weights' dtype (the product's), summed over slots
        blk.save("combine", "router.topk_index")
        blk.comm("combine", ("router.topk_index",), h * max(b, width))
    if shared and not d.traits.shared_expert_first:
        _shared_expert(blk, h_in)

def _dispatch(blk: _Block, h_in: str, weights: str, width: int) -> tuple[str, str, str]:
    """Expert parallelism's dispatch (`parallel.expert`): this rank's experts receive their rows,
    routing weights and local expert ids. Nothing saves them (dispatch and combine keep only the
    router's index, also when the router recomputes), so they cost memory only while a recompute
    region of the experts holds them."""
    h = blk.dims.hidden_size
    rows = blk.tensor("dispatch.rows", "dispatch", blk.pair(h), blk.b)
    ids = blk.tensor("dispatch.expert_ids", "dispatch", blk.pair(1), _I64, floating=False)
    received = blk.tensor("dispatch.weights", "dispatch", blk.pair(1), width)
    blk.save("dispatch", "router.topk_index")  # to sort again in backward
    blk.comm("dispatch", (h_in, weights, "router.topk_index"), h * blk.b + width)
    return rows, ids, received


def _shared_expert(blk: _Block, h_in: str) -> None:
    """The shared expert: a gated MLP on every token; Qwen2-MoE scales it by sigmoid(gate(x))."""
    d, b, h = blk.dims, blk.b, blk.dims.hidden_size
    si = d.shared_expert_intermediate_size
    blk.gated_mlp("shared_expert", h_in, si, h)
    if d.traits.shared_expert_gated:
        blk.save("shared_expert", blk.tensor("shared_expert.gate_sig", "shared_expert", blk.tok(1), b))
        blk.save("shared_expert", blk.tensor("shared_expert.out", "shared_expert", blk.tok(h), b))
        blk.dense_params += h
    blk.op(
        "shared_expert",
        (h_in,),
        blk.tok(6 * h * si),
        LinearForm(const=3 * h * si * b / blk.par.tp) + blk.tok((2 * h + 5 * si) * b),
        kernels=5,
    )


def decoder_layer(dims: ModelDims, par: Parallel, hw: HardwareSpec, moe: bool) -> BlockGraph:
    blk = _Block("moe" if moe else "dense", dims, par, hw)
    blk.tensor("x", INPUT, blk.tok(dims.hidden_size), blk.b)
    residual = _attention(blk, "x")
    _norm_op(blk, "mlp_norm", residual, "mlp_norm.out")
    if moe:
        _moe(blk, "mlp_norm.out")
    else:
        di, h = dims.dense_intermediate_size, dims.hidden_size
        blk.gated_mlp("dense_mlp", "mlp_norm.out", di, h)
        blk.op(
            "dense_mlp",
            ("mlp_norm.out",),
            blk.tok(6 * h * di),
            LinearForm(const=3 * h * di * blk.b / par.tp) + blk.tok((2 * h + 5 * di) * blk.b),
            kernels=5,
        )
    return blk.build()


def embedding(dims: ModelDims, par: Parallel, hw: HardwareSpec) -> BlockGraph:
    """Token embedding (keeps the ids) and the RoPE tables every layer's attention keeps (shared
    by all layers, so no plan of one layer's ops mitigates them)."""
    blk = _Block("embed", dims, par, hw)
    rope = dims.rope_dim or (dims.head_dim if dims.mla is None else dims.mla.qk_rope_head_dim)
    blk.save("embed", blk.tensor("embed.ids", INPUT, LinearForm(per_token=1), _I64, floating=False))
    blk.save("embed", blk.tensor("embed.cos", "embed", LinearForm(per_position=rope), blk.b, shared=True))
    blk.save("embed", blk.tensor("embed.sin", "embed", LinearForm(per_position=rope), blk.b, shared=True))
    # what every layer receives and nothing saves, held by a layer's recompute region that takes
    # it: the position ids, and under eager attention a (B, 1, L, L) mask per attention kind
    layers = tuple(range(dims.num_layers))
    blk.tensor("embed.position_ids", "embed", LinearForm(per_position=1), _I64, floating=False, held_by=layers)
    if dims.attention == "eager":
        kinds = dims.layer_types or ("",) * dims.num_layers
        for kind in dict.fromkeys(kinds):
            users = tuple(i for i in layers if kinds[i] == kind)
            blk.tensor(f"embed.mask{'.' + kind if kind else ''}", "embed", LinearForm(per_score=1), blk.b, held_by=users)
    h = dims.hidden_size
    blk.op("embed", ("embed.ids",), LinearForm(), LinearForm(per_token=(h + 2 * rope) * blk.b + _I64), kernels=4)
    blk.dense_params += dims.vocab_size * h // par.tp
    return blk.build()


def lm_head(dims: ModelDims, par: Parallel, hw: HardwareSpec) -> BlockGraph:
    """Final norm, vocabulary projection (vocab-parallel over tp) and cross-entropy, which keeps
    the FP32 log-probabilities and the targets; recomputing the loss holds the labels instead.
    The chunked loss (`MitigationOptions.loss_chunk_tokens`, `runtime.chunked_loss`) keeps the
    final norm's output, the targets and one FP32 log-sum-exp per token instead of the
    log-probabilities (the paths' tensors are marked `TensorSpec.chunked`)."""
    blk = _Block("head", dims, par, hw)
    h, v = dims.hidden_size, dims.vocab_size
    blk.tensor("x", INPUT, blk.tok(h), blk.b)
    _norm_op(blk, "final_norm", "x", "final_norm.out")
    blk.save("lm_head", "final_norm.out")
    blk.tensor("logits", "lm_head", blk.tok(v), blk.b)
    weights = LinearForm(const=h * v * blk.b / par.tp)
    blk.op("lm_head", ("final_norm.out",), blk.tok(2 * h * v), weights + blk.tok((h + v) * blk.b), kernels=2)
    blk.tensor("labels", INPUT, LinearForm(per_token=1), _I64, floating=False)  # the caller's, as collators copy them
    blk.save("loss", blk.tensor("loss.logprobs", "loss", blk.tok(v), _F32))
    blk.save("loss", blk.tensor("loss.targets", "loss", LinearForm(per_token=1), _I64, floating=False))
    blk.save("loss", blk.tensor("loss.divisor", "loss", LinearForm(const=1), _F32))  # the mean's token count
    blk.save("loss", blk.tensor("loss.hidden", "final_norm", blk.tok(h), blk.b))  # final_norm.out, read by the chunks
    blk.save("loss", blk.tensor("loss.lse", "loss", LinearForm(per_token=1), _F32))
    blk.op("loss", ("logits", "labels", "loss.hidden"), blk.tok(5 * v), blk.tok(v * (blk.b + 3 * _F32)), kernels=6)
    blk.dense_params += h + v * h // par.tp
    paths = {"final_norm.out": False, "loss.logprobs": False, "loss.hidden": True, "loss.lse": True}
    block = blk.build()
    return replace(block, tensors=tuple(replace(t, chunked=paths.get(t.name)) for t in block.tensors))
