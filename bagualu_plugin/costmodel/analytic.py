"""Operator graphs from model dimensions, for models far too large to run here (paper §IV-A).

Each block lists, operator by operator, the storages that HF transformers' modules save for
backward (docs/architecture.md: RMSNorm upcasts to FP32 and keeps the upcast and its reciprocal
norm, linears keep their input, SiLU-gating keeps both halves, the `grouped_mm` experts keep the
gathered tokens and index vectors, sdpa keeps q, k, v, its output and log-sum-exp). Casts that are
no-ops in FP32 share the input's storage, so an FP32 model saves fewer distinct tensors.

Autograd saves only what a gradient it computes needs: a linear keeps its input for its weight's
gradient, a product keeps each factor for the other's. So each block follows which tensors
require grad, and under LoRA (`ModelDims.lora`: frozen weights, trainable adapters) that decides
what is saved: nothing before the first adapter, no input of a frozen linear, but what each
adapter's own linears and dropout keep (`_Block.linear`).

Times follow the roofline of one device: each load coefficient costs the larger of its FLOPs over
peak FLOP/s and its bytes over HBM bandwidth, plus a launch per kernel; backward costs twice the
forward. Tensor parallelism is Megatron-style with sequence parallelism: every per-token term of
attention, norms and dense MLPs is divided by tp; experts are split by expert parallelism only.
"""

from __future__ import annotations

from dataclasses import replace

from ..hardware import HardwareSpec
from .dims import DTYPE_BYTES, EXPERT_TARGETS, ModelDims, Parallel, adapted, adapter_params, attention_params, lora_shapes
from .graph import INPUT, BlockGraph, OpSpec, TensorSpec, standard_spans, standard_units
from .linear import LinearForm

_F32, _I64, _I32 = 4, 8, 4


class _Block:
    """Accumulates ops and tensors of one block; savers are added as ops are declared. `layer`:
    the decoder layer, whose LoRA adapters it has (None: the embedding or the head)."""

    def __init__(self, kind: str, dims: ModelDims, par: Parallel, hw: HardwareSpec, layer: int | None = None):
        self.kind, self.dims, self.par, self.hw, self.layer = kind, dims, par, hw, layer
        self.b = DTYPE_BYTES[dims.dtype]  # the weights' and the residual stream's
        self.c = DTYPE_BYTES[dims.autocast] if dims.autocast else self.b  # what a linear, a matmul and attention compute in
        self.ops: list[OpSpec] = []
        self.tensors: dict[str, dict] = {}
        self.grad: set[str] = set()  # the tensors that require grad
        self.keeps_rope = False  # a decoder layer's RoPE products keep the tables (q or k requires grad)
        self.trains = dims.lora is None  # the model's own weights train (else only the adapters)
        self.dense_params = self.expert_params = 0
        self.transient = LinearForm()  # `BlockGraph.transient`
        self.adapter_params = [0, 0]  # (dense, expert) of the LoRA adapters, in dense_params and expert_params

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
        grad: bool = False,
    ) -> str:
        self.tensors[name] = dict(
            producer=producer, savers=[], elements=elements, dtype_bytes=dtype_bytes, floating=floating, shared=shared,
            held_by=held_by,
        )
        if grad:
            self.grad.add(name)
        return name

    def requires_grad(self, *names: str) -> bool:
        return any(n in self.grad for n in names)

    def save(self, op: str, *names: str, when: bool = True) -> None:
        """`op` saves `names` for backward, if `when` (the gradient that needs them is computed)."""
        for n in names:
            if when and op not in self.tensors[n]["savers"]:
                self.tensors[n]["savers"].append(op)

    def adapts(self, target: str) -> bool:
        return self.dims.lora is not None and self.layer is not None and self.dims.lora.adapts(self.layer, target)

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
        """The block's graph, without the tensors nothing saves, holds or reads (what a frozen op
        would have saved): they cost nothing."""
        read = {name for op in self.ops for name in op.inputs}
        tensors = tuple(
            TensorSpec(
                n, t["producer"], tuple(t["savers"]), t["elements"], t["dtype_bytes"], t["floating"], t["shared"], t["held_by"]
            )
            for n, t in self.tensors.items()
            if t["savers"] or t["held_by"] or n in read
        )
        ops = tuple(op.name for op in self.ops)
        units = standard_units(self.kind, ops, shared_alone=self.dims.traits.shared_expert_alone)
        spans = standard_spans(self.kind, ops)
        dense, expert = self.adapter_params
        frozen = (0, 0) if self.trains else (self.dense_params - dense, self.expert_params - expert)
        return BlockGraph(
            self.kind, tuple(self.ops), tensors, self.dense_params, self.expert_params, units, spans, frozen, self.transient
        )

    # building pieces shared by several ops ------------------------------------------------
    def rmsnorm(self, op: str, prefix: str, inp: str, width: int, groups: int = 1) -> bool:
        """HF RMSNorm over `groups` vectors per token, in `op`: upcast to FP32 (a no-op in FP32,
        which then keeps `inp` itself), keep the upcast and 1/rms for the input's gradient, and the
        normalised input for the weight's: cast back to the model dtype first, except in gpt-oss,
        which multiplies in FP32. Returns whether its output requires grad."""
        given = self.tensors[inp]["dtype_bytes"]
        normed = _F32 if self.dims.traits.norm_multiplies_fp32 else given
        x32 = inp if given == _F32 else self.tensor(f"{prefix}.x32", op, self.tok(width), _F32)
        grad = self.requires_grad(inp)
        self.save(op, x32, self.tensor(f"{prefix}.rstd", op, self.tok(groups), _F32), when=grad)
        self.save(op, self.tensor(f"{prefix}.normed", op, self.tok(width), normed), when=self.trains)
        return grad or self.trains

    def cast(self, op: str, name: str, inp: str) -> str:
        """What an op that autocast casts (a linear, a matmul, attention) reads of `inp` in `op`: a
        copy in the dtype autocast computes in, where it is on and `inp` is of another (a copy per
        reader: autocast keeps only the casts of leaf tensors that require grad), else `inp`."""
        t = self.tensors[inp]
        if self.dims.autocast is None or not t["floating"] or t["dtype_bytes"] == self.c:
            return inp
        return self.tensor(name, op, t["elements"], self.c, grad=self.requires_grad(inp))

    def normed_bytes(self, inp: str) -> int:
        """The dtype of an RMSNorm's output on `inp`: its weight times the input in its own dtype,
        promoted (gpt-oss casts the product back to the input's)."""
        given = self.tensors[inp]["dtype_bytes"]
        return given if self.dims.traits.norm_multiplies_fp32 else max(self.b, given)

    def linear(self, op: str, target: str, inp: str, width: int, weight: int | None = None) -> bool:
        """The linear `target` (its name in the decoder layer; `weight`: its elements on this
        device, if `lora_shapes` does not name it) on `inp` (`width` per token), in `op`. A
        weight that trains keeps the input for its gradient; a frozen one is itself kept for the
        input's gradient (no activation bytes, but a save that keeps a recompute region alive,
        `mitigation.holding_regions`). Under autocast to another dtype than the weights' the
        linear runs on copies of both in that dtype, which it keeps instead. A LoRA adapter on it
        (PEFT's `lora.Linear`: B(A(dropout(x))), x cast to the adapters' dtype first) keeps what
        A and B read: the input, its cast, or dropout's output with, for the input's gradient,
        dropout's mask (its scaled noise off CUDA); and A's output. DeepSpeed ZeRO-3's linear
        (`ModelDims.zero3_linear`) keeps the input of a frozen one too, where the input requires
        grad. Returns whether the output requires grad (the output is in `c`)."""
        x = self.cast(op, f"{target}.x_cast", inp)
        self.save(op, x, when=self.trains or (self.dims.zero3_linear and self.requires_grad(inp)))
        copied = self.b != self.c  # autocast's copy of the weight
        if (copied or not self.trains) and self.requires_grad(inp):
            if weight is None:
                w_in, w_out, _ = lora_shapes(self.dims)[target]
                weight = w_in * w_out // self.par.tp
            self.save(op, self.tensor(f"{target}.weight", op, LinearForm(const=weight) if copied else LinearForm(), self.c))
        if not self.adapts(target):
            return self.trains or self.requires_grad(inp)
        lora, rank = self.dims.lora, self.dims.lora.rank_of(target)
        ab = DTYPE_BYTES[lora.dtype]
        # under autocast to another dtype than the adapters', A and B run in it: on a cast copy of
        # what they read (PEFT's cast to the adapters' dtype, cast again) and of their weights
        cast = self.dims.autocast is not None and ab != self.c
        rb = self.c if cast else ab  # what A reads and returns
        given = self.tensors[inp]["dtype_bytes"]
        x = inp if given == ab and not cast else self.tensor(f"{target}.lora_x", op, self.tok(width), rb)
        if lora.dropout:
            fused = self.dims.device == "cuda"  # a bool mask, else the noise in the adapters' dtype
            noise = self.tensor(f"{target}.lora_mask", op, self.tok(width), 1 if fused else ab, floating=not fused)
            self.save(op, noise, when=self.requires_grad(inp))
            x = self.tensor(f"{target}.lora_dropped", op, self.tok(width), rb)
        self.save(op, x, self.tensor(f"{target}.lora_a", op, self.tok(rank), rb))
        if cast:  # each kept for its input's gradient: A's only where the layer's input needs one
            w_in, w_out, _ = lora_shapes(self.dims)[target]
            self.save(op, self.tensor(f"{target}.lora_A.cast", op, LinearForm(const=rank * w_in), self.c), when=self.requires_grad(inp))
            self.save(op, self.tensor(f"{target}.lora_B.cast", op, LinearForm(const=rank * w_out), self.c))
        self.add_adapter(target)
        return True

    def add_adapter(self, target: str, expert: bool = False) -> None:
        """Count `target`'s adapter parameters among the dense or the `expert` ones (the
        router's), as this device holds them: the local experts' share of the experts' own, a
        tensor-parallel share of a dense one."""
        count = adapter_params(self.dims, self.layer, (target,))
        if target in EXPERT_TARGETS:
            expert, count = True, count // self.par.ep
        elif not expert:
            count //= self.par.tp
        self.adapter_params[expert] += count
        if expert:
            self.expert_params += count
        else:
            self.dense_params += count

    def gated_mlp(self, op: str, prefix: str, inp: str, inter: int) -> bool:
        """down(silu(gate(x)) * up(x)) of the MLP `prefix`: x for the weights' gradients, SiLU's
        input, each factor of the product for the other's gradient, the product for down's.
        Returns whether the output requires grad."""
        h, b = self.dims.hidden_size, self.c
        gate = self.linear(op, f"{prefix}.gate_proj", inp, h)
        up = self.linear(op, f"{prefix}.up_proj", inp, h)
        self.save(op, self.tensor(f"{op}.gate", op, self.tok(inter), b), when=gate)
        self.save(op, self.tensor(f"{op}.silu", op, self.tok(inter), b), when=up)
        self.save(op, self.tensor(f"{op}.up", op, self.tok(inter), b), when=gate)
        prod = self.tensor(f"{op}.prod", op, self.tok(inter), b, grad=gate or up)
        self.dense_params += 3 * h * inter // self.par.tp
        return self.linear(op, f"{prefix}.down_proj", prod, inter)


def _norm_op(blk: _Block, op: str, inp: str, out: str) -> None:
    h = blk.dims.hidden_size
    blk.tensor(out, op, blk.tok(h), blk.normed_bytes(inp), grad=blk.rmsnorm(op, op, inp, h))
    blk.op(op, (inp,), blk.tok(4 * h), blk.tok((2 * blk.b + 2 * _F32) * h), kernels=6)
    blk.dense_params += h


def _attention(blk: _Block, inp: str) -> str:
    """attn_norm, attn_qkv, attn_core, attn_out; returns the residual stream after attention.

    attn_qkv ends with the last projection, so RoPE belongs to attn_core (docs/architecture.md),
    which keeps the rotated q and k, a contiguous v, and either the kernel's output and
    log-sum-exp (sdpa) or the (heads x L x L) probabilities (eager). The context handed to the
    output projection is the kernel's output itself, except where q and k were re-assembled with
    cat (partial rotary, MLA): then the output lands head-major and the context is a copy. sdpa's
    backward is one kernel, which keeps all of it as soon as one of q, k, v requires grad; eager
    attention's products keep each factor only for the other's gradient.
    """
    d, b, c = blk.dims, blk.b, blk.c
    h, nh, nkv, hd = d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim
    _norm_op(blk, "attn_norm", inp, "attn_norm.out")

    def proj(name: str, source: str = "attn_norm.out", width: int = h) -> bool:
        return blk.linear("attn_qkv", f"self_attn.{name}", source, width)

    if d.mla is None:
        q_w, k_w, v_w, ctx_w = nh * hd, nkv * hd, nkv * hd, nh * hd
        grads = {"q": proj("q_proj"), "k": proj("k_proj"), "v": proj("v_proj")}
        if d.qk_norm:  # per-head RMSNorm on q and k after their projections
            for name, w in (("q", q_w), ("k", k_w)):
                raw = blk.tensor(f"attn_qkv.{name}_raw", "attn_qkv", blk.tok(w), c, grad=grads[name])
                grads[name] = blk.rmsnorm("attn_qkv", f"attn_qkv.{name}_norm", raw, w, groups=w // hd)
        q_grad, k_grad, v_grad = grads.values()
        rope_grad = q_grad or k_grad
        proj_flops = 2 * h * (q_w + k_w + v_w)
        core_q, core_k = "attn_core", "attn_core"  # RoPE makes them inside attn_core
    else:
        m = d.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q_w, k_w, v_w, ctx_w = nh * qk, nh * qk, nh * m.v_head_dim, nh * m.v_head_dim

        def latent(name: str, rank: int, raw_width: int, down: str, up: str) -> bool:
            """The low-rank latent, RMS-normalised before its up-projection."""
            raw = blk.tensor(f"attn_qkv.{name}_out", "attn_qkv", blk.tok(raw_width), c, grad=proj(down))
            normed = blk.rmsnorm("attn_qkv", f"attn_qkv.{name}_norm", raw, rank)
            out = blk.tensor(f"attn_qkv.{name}_normed_out", "attn_qkv", blk.tok(rank), blk.normed_bytes(raw), grad=normed)
            return proj(up, out, rank)

        q_grad = latent("q_a", m.q_lora_rank, m.q_lora_rank, "q_a_proj", "q_b_proj") if m.q_lora_rank else proj("q_proj")
        v_grad = latent("kv_a", m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim, "kv_a_proj_with_mqa", "kv_b_proj")
        kv_a = blk.requires_grad("attn_qkv.kv_a_out")  # k's rotated part, shared by the heads
        rope_grad, k_grad = q_grad or kv_a, v_grad or kv_a
        q_flops = 2 * h * q_w if m.q_lora_rank == 0 else 2 * m.q_lora_rank * (h + q_w)
        kv_flops = 2 * h * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
        proj_flops = q_flops + kv_flops
        # q is assembled with cat before kv_b_proj; k after it (in attn_core); v is a view of
        # kv_b_proj's output, which a fused kernel keeps whole (nope and v columns)
        blk.tensor("attn_qkv.kv_b_out", "attn_qkv", blk.tok(nh * (m.qk_nope_head_dim + m.v_head_dim)), c)
        core_q, core_k = "attn_qkv", "attn_core"
    blk.keeps_rope = rope_grad  # RoPE's products keep the tables for q's and k's gradients
    # what the projections hand to attention's core: q and k rotated with the residual stream's
    # tables (in its dtype), v as its projection made it
    for name, w, grad, size in (("q_in", q_w, q_grad, b), ("k_in", k_w, k_grad, b), ("v_in", v_w, v_grad, c)):
        blk.tensor(name, "attn_qkv", blk.tok(w), size, grad=grad)
    blk.op(
        "attn_qkv",
        ("attn_norm.out",),
        blk.tok(proj_flops),
        LinearForm(const=attention_params(d) * b / blk.par.tp) + blk.tok((h + 2 * (q_w + k_w + v_w)) * b),
        kernels=12,
    )

    sinks = d.traits.attention_sinks  # learned per-head sinks add one logit column, max-subtracted
    # repeat_kv copies k, v per query head: for eager attention, and for SDPA given a mask
    # (transformers passes enable_gqa only without one), which it then keeps in q's dtype
    repeat = d.mla is None and nkv != nh and d.attention != "sdpa"
    sdpa, masked = d.attention != "eager", d.attention == "sdpa_masked"
    any_grad, scores_grad = q_grad or k_grad or v_grad, q_grad or k_grad
    # autocast to another dtype than the stream's casts q and k in attention's core
    core_q = "attn_core" if b != c else core_q
    blk.save("attn_core", blk.tensor("attn_core.q", core_q, blk.tok(q_w), c), when=any_grad if sdpa else k_grad)
    blk.save("attn_core", blk.tensor("attn_core.k", core_k, blk.tok(nh * hd if repeat else k_w), c), when=any_grad if sdpa else q_grad)
    if d.mla is not None and sdpa:
        blk.save("attn_core", "attn_qkv.kv_b_out", when=any_grad)
    else:  # a contiguous v; eager MLA keeps the whole key/value projection for one sequence
        v = blk.tok(nh * hd if repeat else v_w)
        if d.mla is not None:
            v += LinearForm(per_single_token=nh * d.mla.qk_nope_head_dim / blk.par.tp)
        blk.save("attn_core", blk.tensor("attn_core.v", "attn_core", v, c), when=any_grad if sdpa else scores_grad)
    copy_ctx = d.partial_rotary or d.mla is not None
    if sdpa:
        blk.save("attn_core", blk.tensor("attn_core.lse", "attn_core", blk.tok(nh), _F32), when=any_grad)
        blk.save("attn_core", blk.tensor("attn_core.mask", "attn_core", LinearForm(per_score=1), c), when=masked and any_grad)
        if copy_ctx:
            blk.save("attn_core", blk.tensor("attn_core.out", "attn_core", blk.tok(ctx_w), c), when=any_grad)
    elif sinks:  # softmax in the model dtype over L + 1 columns, after subtracting the row max
        probs = blk.tensor("attn_core.probs", "attn_core", blk.score(nh) + blk.tok(nh), b)
        blk.save("attn_core", probs, when=any_grad)  # softmax's output, and the scores' view of it v's gradient reads
        if c != b:  # under autocast to another dtype the product with v reads a copy of that view
            blk.save("attn_core", blk.tensor("attn_core.probs_cast", "attn_core", blk.score(nh), c), when=v_grad)
        blk.save("attn_core", blk.tensor("attn_core.max_index", "attn_core", blk.tok(nh), _I64, floating=False), when=scores_grad)
    else:  # softmax in FP32, cast back to q's dtype, and to autocast's for the product with v
        probs32 = blk.tensor("attn_core.probs32", "attn_core", blk.score(nh), _F32)
        blk.save("attn_core", probs32, when=scores_grad or (v_grad and c == _F32))
        if c != _F32:
            blk.save("attn_core", blk.tensor("attn_core.probs", "attn_core", blk.score(nh), c), when=v_grad)
    blk.tensor("ctx", "attn_core", blk.tok(ctx_w), c, grad=any_grad)
    blk.save("attn_core", "ctx", when=sdpa and not copy_ctx and any_grad)
    qk_dim = q_w // nh
    blk.op(
        "attn_core",
        ("q_in", "k_in", "v_in"),
        blk.score(nh * (qk_dim + ctx_w // nh)),  # 2 FLOPs x 2 matmuls, halved by the causal mask
        blk.tok((q_w + k_w + v_w + 2 * ctx_w) * b) + (blk.score(nh * 2 * _F32) if d.attention == "eager" else LinearForm()),
        kernels=4 if sdpa else 8,
    )

    out = blk.linear("attn_out", "self_attn.o_proj", "ctx", ctx_w)
    blk.tensor("attn_out.residual", "attn_out", blk.tok(h), b, grad=out or blk.requires_grad(inp))
    weights = LinearForm(const=ctx_w * h * b / blk.par.tp)
    blk.op("attn_out", ("ctx",), blk.tok(2 * ctx_w * h), weights + blk.tok((ctx_w + 2 * h) * b), kernels=2)
    blk.dense_params += attention_params(d) // blk.par.tp
    return "attn_out.residual"


def _router(blk: _Block, h_in: str) -> str:
    """The router's saved tensors; returns the routing weights it hands to the experts.

    GLM-4 and DeepSeek-V3 route in FP32 through a sigmoid (keeping an FP32 copy of a low-precision
    input); Qwen and Mixtral through an FP32 softmax; gpt-oss softmaxes only the top-k logits.
    All keep the top-k index; renormalised weights keep the raw top-k and their sum (FP32 under
    CUDA's autocast, which sums in FP32). The weights
    stay FP32 except where Qwen and gpt-oss cast them to the model dtype; gpt-oss hands on the very
    softmax output it keeps. The input is kept for the router's weight, the rest for the input's
    gradient.
    """
    d, b, c = blk.dims, blk.b, blk.c
    h, E, k = d.hidden_size, d.num_experts, d.top_k
    fp32 = d.traits.router_fp32
    given = blk.tensors[h_in]["dtype_bytes"]
    # an FP32 router (its weight kept FP32) computes in FP32 on an FP32 copy of its input; under
    # autocast to another dtype its linear runs in that dtype, on copies of its input and weight,
    # and so do the scores of a sigmoid router
    read = _F32 if fp32 else given  # the input the router's linear is given
    logits = c if d.autocast else read
    r = logits if fp32 else _F32  # the scores: a sigmoid's of the logits, else a softmax's in FP32
    copied = (fp32 and given != _F32) or logits != read  # the router's input is a tensor of its own
    x = blk.tensor("router.x32", "router", blk.tok(h), logits) if copied else h_in
    target = f"mlp.{d.traits.router}.weight"
    adapted = blk.adapts(target)  # PEFT's ParamWrapper: W + scale B A, made in the router and kept for the input's gradient
    blk.save("router", x, when=blk.trains or adapted or (d.zero3_linear and blk.requires_grad(h_in)))  # F.linear, as linear()
    stored = DTYPE_BYTES[d.router_dtype] if d.router_dtype else _F32 if fp32 else b
    given_weight = _F32 if fp32 else stored  # an FP32 router hands its linear an FP32 weight (a copy of another)
    if adapted or stored != given_weight or logits != given_weight:  # the weight the linear keeps is a tensor of its own
        weight = blk.tensor("router.weight", "router", LinearForm(const=E * h), logits)
        blk.save("router", weight, when=blk.requires_grad(h_in))
    if adapted:
        ab = DTYPE_BYTES[d.lora.dtype]
        # B A of copies, each kept for the other: FP32 ones on CPU of lower-precision adapters, and
        # under autocast to the model dtype the casts of FP32 adapters to it
        copies = _F32 if d.device == "cpu" and ab < _F32 else c if d.autocast and ab != c else None
        if copies is not None:
            rank = d.lora.rank_of(target)
            for side, w in (("in", h), ("out", E)):
                blk.save("router", blk.tensor(f"router.weight.lora_{side}", "router", LinearForm(const=rank * w), copies))
        blk.add_adapter(target, expert=True)
    grad = blk.trains or adapted or blk.requires_grad(h_in)
    if d.traits.router_topk_softmax:
        blk.save("router", blk.tensor("router.topk_softmax", "router", blk.tok(k), logits, grad=grad), when=grad)
    else:
        blk.save("router", blk.tensor("router.scores", "router", blk.tok(E), r), when=grad)
    blk.save("router", blk.tensor("router.topk_index", "router", blk.tok(k), _I64, floating=False), when=grad)
    if d.norm_topk_prob:  # CUDA's autocast sums a half-precision tensor in FP32, the CPU's in its dtype
        blk.save("router", blk.tensor("router.topk_raw", "router", blk.tok(k), r), when=grad)
        total = _F32 if d.autocast and d.device == "cuda" else r
        blk.save("router", blk.tensor("router.topk_sum", "router", blk.tok(1), total), when=grad)
    blk.op("router", (h_in,), blk.tok(2 * h * E), LinearForm(const=E * h * _F32) + blk.tok(h * b + 3 * E * _F32), kernels=10)
    blk.expert_params += E * h + (E if d.traits.expert_bias else 0)
    if d.traits.router_topk_softmax:
        return "router.topk_softmax"
    return blk.tensor("topk_weights", "router", blk.tok(k), r if d.traits.routing_weights_fp32 else logits, grad=grad)


def _moe(blk: _Block, h_in: str) -> None:
    """router, expert_fc1, expert_act, expert_fc2 (the "bagualu" experts: grouped_mm split in
    three), shared_expert.

    Each grouped linear keeps its rows for its weight's gradient and its weight for the rows'
    gradient: under LoRA on the fused expert weights (PEFT's `ParamWrapper`) that weight is
    W + scale B A, made once per forward in the op that first reads it and kept whole (with the
    low-rank factors cast to the model dtype, where the adapters' dtype differs)."""
    d, b = blk.dims, blk.b
    h, E, inter = d.hidden_size, d.num_experts, d.moe_intermediate_size
    local = E // blk.par.ep
    shared = d.shared_expert_intermediate_size > 0
    if shared and d.traits.shared_expert_first:
        _shared_expert(blk, h_in)
    weights = _router(blk, h_in)
    bias = d.traits.expert_bias and blk.trains
    width = blk.tensors[weights]["dtype_bytes"]
    rows, index = h_in, "router.topk_index"
    if blk.par.dispatches:
        rows, index, weights = _dispatch(blk, h_in, weights, width)
    routed, weighted = blk.requires_grad(rows), blk.requires_grad(weights)
    fc1_w, fc2_w = (blk.trains or blk.adapts(t) for t in EXPERT_TARGETS)
    fc1_grad = routed or fc1_w
    fc2_grad = fc1_grad or fc2_w

    offsets = blk.tensor("experts.offsets", "expert_fc1", LinearForm(const=local), _I32, floating=False)
    blk.save("expert_fc1", offsets, when=fc1_grad)
    blk.save("expert_fc1", blk.tensor("expert_fc1.token_index", "expert_fc1", blk.pair(1), _I64, floating=False), when=routed)
    ids = blk.tensor("expert_fc1.expert_ids", "expert_fc1", blk.pair(1), _I64, floating=False)
    blk.save("expert_fc1", ids, when=bias)  # per-pair bias rows are gathered by expert id, in fc1 and again in fc2
    blk.save("expert_fc2", ids, when=bias)
    blk.save("expert_fc1", blk.tensor("expert_fc1.x", "expert_fc1", blk.pair(h), b), when=fc1_w)
    _adapted_experts(blk, "expert_fc1", EXPERT_TARGETS[0], when=routed)
    blk.tensor("fc1_out", "expert_fc1", blk.pair(2 * inter), b, grad=fc1_grad)
    perm = blk.tensor("expert_fc1.pair_perm", "expert_fc1", blk.pair(1), _I64, floating=False)
    blk.op(
        "expert_fc1",
        (rows, index),  # without EP, the index the router returns is the one it keeps
        blk.pair(2 * h * 2 * inter),
        LinearForm(const=local * 2 * inter * h * b) + blk.pair((2 * h + 2 * inter) * b),
        kernels=6,
    )

    # SiLU gating keeps silu(gate); gpt-oss's clamped SwiGLU keeps four I-wide intermediates
    blk.save("expert_act", "fc1_out", when=fc1_grad)
    for i in range(d.traits.expert_act_saves):
        blk.save("expert_act", blk.tensor(f"expert_act.t{i}", "expert_act", blk.pair(inter), b), when=fc1_grad)
    blk.tensor("act_out", "expert_act", blk.pair(inter), b)
    blk.op("expert_act", ("fc1_out",), blk.pair(5 * inter), blk.pair(4 * inter * b), kernels=2)

    # the routing weights gathered by perm, times the rows; back to token order by the inverse
    blk.save("expert_fc2", offsets, when=fc2_grad)
    blk.save("expert_fc2", perm, when=weighted)
    blk.save("expert_fc2", "act_out", when=fc2_w)
    _adapted_experts(blk, "expert_fc2", EXPERT_TARGETS[1], when=fc1_grad)
    inverse = blk.tensor("expert_fc2.inverse_perm", "expert_fc2", blk.pair(1), _I64, floating=False)
    blk.save("expert_fc2", inverse, when=fc2_grad or weighted)
    blk.save("expert_fc2", blk.tensor("expert_fc2.weights", "expert_fc2", blk.pair(1), width), when=fc2_grad)
    blk.save("expert_fc2", blk.tensor("expert_fc2.y", "expert_fc2", blk.pair(h), b), when=weighted)
    blk.op(
        "expert_fc2",
        ("act_out", ids, perm, offsets, weights),
        blk.pair(2 * inter * h + h),
        LinearForm(const=local * inter * h * b) + blk.pair((inter + 3 * h) * b),
        kernels=5,
    )
    blk.expert_params += local * (3 * h * inter + (2 * inter + h if d.traits.expert_bias else 0))
    if blk.par.dispatches:  # the weighted rows back, in the weights' dtype (the product's), summed over slots
        blk.save("combine", "router.topk_index", when=fc2_grad or weighted)
        blk.comm("combine", ("router.topk_index",), h * max(b, width))
    if shared and not d.traits.shared_expert_first:
        _shared_expert(blk, h_in)


def _adapted_experts(blk: _Block, op: str, target: str, when: bool) -> None:
    """The weight W + scale B A that `op` reads under LoRA on `target`, kept for the rows'
    gradient (`when`), and its low-rank factors, cast to the model dtype where the adapters'
    differs (the product keeps each for the other's gradient)."""
    if not blk.adapts(target):
        return
    d, local = blk.dims, blk.dims.num_experts // blk.par.ep
    w_in, w_out, _ = lora_shapes(d)[target]
    name = target.rsplit(".", 1)[1]
    blk.save(op, blk.tensor(f"{op}.{name}", op, LinearForm(const=local * w_in * w_out), blk.b), when=when)
    if DTYPE_BYTES[d.lora.dtype] != blk.b:
        for side, w in (("in", w_in), ("out", w_out)):
            blk.save(op, blk.tensor(f"{op}.{name}.lora_{side}", op, LinearForm(const=local * d.lora.rank_of(target) * w), blk.b))
    blk.add_adapter(target)


def _dispatch(blk: _Block, h_in: str, weights: str, width: int) -> tuple[str, str, str]:
    """Expert parallelism's dispatch (`parallel.expert`): this rank's experts receive their rows,
    routing weights and local expert ids. Nothing saves them (dispatch and combine keep only the
    router's index, also when the router recomputes), so they cost memory only while a recompute
    region of the experts holds them."""
    h = blk.dims.hidden_size
    rows = blk.tensor("dispatch.rows", "dispatch", blk.pair(h), blk.b, grad=blk.requires_grad(h_in))
    ids = blk.tensor("dispatch.expert_ids", "dispatch", blk.pair(1), _I64, floating=False)
    received = blk.tensor("dispatch.weights", "dispatch", blk.pair(1), width, grad=blk.requires_grad(weights))
    blk.save("dispatch", "router.topk_index", when=blk.requires_grad(h_in, weights))  # to sort again in backward
    blk.comm("dispatch", (h_in, weights, "router.topk_index"), h * blk.b + width)
    return rows, ids, received


def _shared_expert(blk: _Block, h_in: str) -> None:
    """The shared expert: a gated MLP on every token; Qwen2-MoE scales it by sigmoid(gate(x)),
    whose output the sigmoid and the product keep, and the product the expert's output."""
    d, b, c, h = blk.dims, blk.b, blk.c, blk.dims.hidden_size
    si, names = d.shared_expert_intermediate_size, d.traits.shared
    out = blk.gated_mlp("shared_expert", f"mlp.{names[0]}", h_in, si)
    if d.traits.shared_expert_gated:
        gate = blk.linear("shared_expert", f"mlp.{names[1]}", h_in, h)
        blk.save("shared_expert", blk.tensor("shared_expert.gate_sig", "shared_expert", blk.tok(1), c), when=gate or out)
        blk.save("shared_expert", blk.tensor("shared_expert.out", "shared_expert", blk.tok(h), c), when=gate)
        blk.dense_params += h
    blk.op(
        "shared_expert",
        (h_in,),
        blk.tok(6 * h * si),
        LinearForm(const=3 * h * si * b / blk.par.tp) + blk.tok((2 * h + 5 * si) * b),
        kernels=5,
    )


def _decoder_layer(dims: ModelDims, par: Parallel, hw: HardwareSpec, layer: int) -> _Block:
    moe = layer >= dims.first_k_dense
    blk = _Block("moe" if moe else "dense", dims, par, hw, layer)
    blk.tensor("x", INPUT, blk.tok(dims.hidden_size), blk.b, grad=_input_grad(dims, layer))
    residual = _attention(blk, "x")
    _norm_op(blk, "mlp_norm", residual, "mlp_norm.out")
    if moe:
        _moe(blk, "mlp_norm.out")
    else:
        di, h = dims.dense_intermediate_size, dims.hidden_size
        blk.gated_mlp("dense_mlp", "mlp", "mlp_norm.out", di)
        blk.op(
            "dense_mlp",
            ("mlp_norm.out",),
            blk.tok(6 * h * di),
            LinearForm(const=3 * h * di * blk.b / par.tp) + blk.tok((2 * h + 5 * di) * blk.b),
            kernels=5,
        )
    return blk


def _input_grad(dims: ModelDims, layer: int) -> bool:
    """Whether a decoder layer's input requires grad: always when the embedding trains; under
    LoRA once an earlier layer has an adapter (the residual stream carries its output on)."""
    return dims.lora is None or any(adapted(dims, i) for i in range(layer))


def blocks(dims: ModelDims, par: Parallel, hw: HardwareSpec) -> dict[int, BlockGraph]:
    """Every block: the embedding (-1), the decoder layers (one graph shared by the layers that
    save alike) and the LM head (num_layers)."""
    graphs, layers = {}, {}
    for i in range(dims.num_layers):
        key = (i >= dims.first_k_dense, _input_grad(dims, i), adapted(dims, i))
        if key not in graphs:
            blk = _decoder_layer(dims, par, hw, i)
            graphs[key] = blk.build(), blk.keeps_rope
        layers[i] = graphs[key][0]
    keeps_rope = any(keeps for _, keeps in graphs.values())
    return {-1: embedding(dims, par, hw, keeps_rope), **layers, dims.num_layers: lm_head(dims, par, hw)}


def embedding(dims: ModelDims, par: Parallel, hw: HardwareSpec, keeps_rope: bool = True) -> BlockGraph:
    """Token embedding (keeps the ids for its weight's gradient) and the RoPE tables every
    layer's attention keeps (shared by all layers, so no plan of one layer's ops mitigates them).
    `keeps_rope`: some layer's RoPE keeps them (q or k requires grad); else, like the position
    ids, only a recompute region that takes them holds them."""
    blk = _Block("embed", dims, par, hw)
    rope = dims.rope_dim or (dims.head_dim if dims.mla is None else dims.mla.qk_rope_head_dim)
    blk.save("embed", blk.tensor("embed.ids", INPUT, LinearForm(per_token=1), _I64, floating=False), when=blk.trains)
    # what every layer receives and nothing saves, held by a layer's recompute region that takes
    # it: the position ids, and a (B, 1, L, L) mask per attention kind under eager attention (in
    # the model's dtype) or SDPA given a mask (boolean)
    layers = tuple(range(dims.num_layers))
    for table in ("embed.cos", "embed.sin"):
        held = () if keeps_rope else layers
        blk.save("embed", blk.tensor(table, "embed", LinearForm(per_position=rope), blk.b, shared=True, held_by=held), when=keeps_rope)
    blk.tensor("embed.position_ids", "embed", LinearForm(per_position=1), _I64, floating=False, held_by=layers)
    if dims.attention != "sdpa":
        kinds = dims.layer_types or ("",) * dims.num_layers
        mask_bytes = blk.b if dims.attention == "eager" else 1
        for kind in dict.fromkeys(kinds):
            users = tuple(i for i in layers if kinds[i] == kind)
            blk.tensor(f"embed.mask{'.' + kind if kind else ''}", "embed", LinearForm(per_score=1), mask_bytes, held_by=users,
                       floating=dims.attention == "eager")
    h = dims.hidden_size
    blk.op("embed", ("embed.ids",), LinearForm(), LinearForm(per_token=(h + 2 * rope) * blk.b + _I64), kernels=4)
    blk.dense_params += dims.vocab_size * h // par.tp
    return blk.build()


def lm_head(dims: ModelDims, par: Parallel, hw: HardwareSpec) -> BlockGraph:
    """Final norm, vocabulary projection (vocab-parallel over tp) and cross-entropy, which keeps
    the FP32 log-probabilities and the targets; recomputing the loss holds the labels instead.
    Given no labels (`lm_head="hf_logits"`) the head returns its logits and keeps nothing more.
    The chunked loss (`MitigationOptions.loss_chunk_tokens`, `runtime.chunked_loss`) keeps the
    final norm's output, the targets and one FP32 log-sum-exp per token instead of the
    log-probabilities (the paths' tensors are marked `TensorSpec.chunked`)."""
    blk = _Block("head", dims, par, hw)
    h, v = dims.hidden_size, dims.vocab_size
    blk.tensor("x", INPUT, blk.tok(h), blk.b, grad=True)  # the embedding or an adapter is upstream
    _norm_op(blk, "final_norm", "x", "final_norm.out")
    _router_aux_loss(blk)
    if dims.lm_head == "trl_fused":
        return _trl_fused_head(blk)
    blk.linear("lm_head", "lm_head", "final_norm.out", h, weight=v * h // par.tp)
    blk.tensor("logits", "lm_head", blk.tok(v), blk.c)
    weights = LinearForm(const=h * v * blk.b / par.tp)
    blk.op("lm_head", ("final_norm.out",), blk.tok(2 * h * v), weights + blk.tok((h + v) * blk.b), kernels=2)
    if dims.lm_head == "hf_logits":  # no labels: the logits are the forward's output, and nothing more is kept
        blk.op("loss", ("logits",), LinearForm(), LinearForm(), kernels=0)
        blk.dense_params += v * h // par.tp
        return blk.build()
    blk.tensor("labels", INPUT, LinearForm(per_token=1), _I64, floating=False)  # the caller's, as collators copy them
    blk.save("loss", blk.tensor("loss.logprobs", "loss", blk.tok(v), _F32))
    # the shifted labels: a view of the padded row for one sequence, a copy for several
    blk.save("loss", blk.tensor("loss.targets", "loss", LinearForm(per_token=1, per_single=1), _I64, floating=False))
    blk.save("loss", blk.tensor("loss.divisor", "loss", LinearForm(const=1), _F32))  # the mean's token count
    if dims.loss_divisor_bytes:  # the caller's token count the summed loss is divided by
        blk.save("loss", blk.tensor("loss.items", INPUT, LinearForm(const=1), dims.loss_divisor_bytes, floating=False))
    blk.save("loss", blk.tensor("loss.hidden", "final_norm", blk.tok(h), blk.b))  # final_norm.out, read by the chunks
    blk.save("loss", blk.tensor("loss.lse", "loss", LinearForm(per_token=1), _F32))
    blk.op("loss", ("logits", "labels", "loss.hidden"), blk.tok(5 * v), blk.tok(v * (blk.b + 3 * _F32)), kernels=6)
    blk.dense_params += v * h // par.tp  # the final norm's are its op's
    paths = {"final_norm.out": False, "loss.logprobs": False, "loss.hidden": True, "loss.lse": True}
    block = blk.build()
    return replace(block, tensors=tuple(replace(t, chunked=paths.get(t.name)) for t in block.tensors))


def _trl_fused_head(blk: _Block) -> BlockGraph:
    """TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`, which SFTTrainer installs): the
    backbone's output, shifted, goes through TRL's own autograd function, which projects it onto
    the vocabulary in tiles and keeps, per position with a next token (B x (L - 1): T - N), a
    contiguous copy of the hidden state (of one sequence, the whole output it is a view of), the
    target, the FP32 log-normaliser and entropy; the
    per-token outputs are masked (a boolean mask each, for log-probabilities and entropy) and the
    loss divides by a count (the caller's `num_items_in_batch`, or its own integer one). No logits
    exist. Nothing of it can be mitigated by a plan (the function is TRL's), so its tensors are
    kept whatever the plan (`shared`). On a GPU TRL keeps only the positions with a label, fewer:
    this is then an upper bound."""
    h, v, b = blk.dims.hidden_size, blk.dims.vocab_size, blk.b
    rows = LinearForm(per_token=1, per_sequence=-1)
    for name, width, size in (("hidden", h, b), ("targets", 1, _I64), ("log_z", 1, _F32), ("entropy", 1, _F32), ("mask", 1, 1),
                              ("entropy_mask", 1, 1)):
        floating = name in ("hidden", "log_z", "entropy")
        # one sequence: its shifted hidden rows are already contiguous, a view of the whole
        # backbone output, whose storage (all L rows) the function then keeps
        whole = width if name == "hidden" else 0
        blk.save("loss", blk.tensor(f"loss.{name}", "loss", LinearForm(per_token=width, per_sequence=-width, per_single=whole), size,
                                    floating=floating, shared=True))
    divisor = blk.dims.loss_divisor_bytes or _I64  # the caller's token count, else the count of labelled positions
    blk.save("loss", blk.tensor("loss.divisor", "loss", LinearForm(const=1), divisor, floating=False, shared=True))
    blk.op("lm_head", ("final_norm.out",), LinearForm(), LinearForm(), kernels=0)  # inside TRL's function: "loss"
    weights = LinearForm(const=h * v * b / blk.par.tp)  # read in forward, and again to recompute the tiles in backward
    blk.op("loss", ("final_norm.out",), LinearForm(per_token=6 * h * v), weights + rows * (h * b + 4 * _F32), kernels=8)
    blk.dense_params += v * h // blk.par.tp  # the final norm's are its op's
    return blk.build()


def _router_aux_loss(blk: _Block) -> None:
    """The load-balancing loss (transformers' `load_balancing_loss_func`, with output_router_logits)
    at the head, over every MoE layer's router logits: a softmax per layer keeps its
    probabilities (in the logits' dtype), and the product with the (gradient-free) tokens per expert keeps those; with
    an attention mask the probabilities are weighted by the flat FP32 mask, and divided by its
    sum. Kept whatever the plan: the head computes it from logits the routers returned. Its top-k
    saves the selected experts' indices, freed with the unused top-k values before the loss
    returns: a moment's room of every MoE layer's (transformers 5.24 takes them all at once from
    the concatenated logits; 5.25 layer by layer, at most two alive together)."""
    d = blk.dims
    if d.router_aux_loss == "none":
        return
    e, moe = d.num_experts, d.num_layers - d.first_k_dense
    blk.transient = LinearForm(per_token=moe * d.top_k * _I64)
    tensors = [("probs", LinearForm(per_token=e * moe), blk.c), ("tokens_per_expert", LinearForm(const=e), _F32)]
    if d.router_aux_loss == "attention_mask":
        tensors += [("mask", LinearForm(per_token=1), _F32), ("rows", LinearForm(const=1), _F32)]
    for name, elements, size in tensors:
        blk.save("loss", blk.tensor(f"aux.{name}", "loss", elements, size, shared=True))
