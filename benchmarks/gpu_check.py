"""One-shot check of the CUDA paths on a GPU (runtime/storage.py, runtime/ledger.py, kernels/):
what CPU tests cannot show. Each check runs on its own; a failure or an exception is a FAIL row
with its text, and the next check runs. Prints one table (check, result, figure, status), also
written to $OUT/gpu_check.txt when OUT is set; exits 1 if any check failed.

    python benchmarks/gpu_check.py            (about 1-3 min on one GPU)
    python benchmarks/gpu_check.py --quick    (fewer families and kernel cases)
    python benchmarks/gpu_check.py --cpu      (reduced mode, also taken without CUDA: the checks
                                               that need a GPU are skipped, the others run on CPU)

Bitwise comparisons run with deterministic algorithms and eager attention (sdpa's CUDA backward
kernels accumulate with atomics); each states whether the unmitigated run reproduces itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import argparse
import json
import math
import platform
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable

import torch

import bagualu_plugin as bgl
from bagualu_plugin import kernels
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.adapters.tiny import tiny_config
from bagualu_plugin.costmodel import ForwardKind, OpId
from bagualu_plugin.costmodel.mitigation import MitigationOptions
from bagualu_plugin.costmodel.plan import Plan
from bagualu_plugin.kernels import reference as ref
from bagualu_plugin.report import table
from bagualu_plugin.runtime.ledger import _storage
from bagualu_plugin.runtime.plan_runtime import PlanRuntime

# Tolerances of tests/test_mitigation.py (e4m3: half an ulp of 3 mantissa bits per rounding).
FP8_ONE_OP, FP8_ALL_OPS, INT8_ALL_OPS = 2**-4, 2 * 2**-4, 0.025


class Skip(Exception):
    """A check that cannot run here (no CUDA, one GPU): a SKIP row, not a failure."""


class Context:
    def __init__(self, device: torch.device, quick: bool):
        self.device, self.quick, self.cuda = device, quick, device.type == "cuda"
        self.families = ["qwen3_moe", "glm4_moe"] if quick else ["qwen3_moe", "glm4_moe", "deepseek_v3", "qwen2_moe", "mixtral", "gpt_oss"]
        # The reduced CPU mode runs every code path once, on short sequences: it is a CI test.
        self.micro_batches = 3 if self.cuda else 1
        self.dtypes = (torch.float32, torch.bfloat16) if self.cuda else (torch.float32,)
        if not self.cuda:
            self.families = self.families[:1]

    def seq(self, n: int) -> int:
        return n if self.cuda else min(n, 24)

    def need_cuda(self) -> None:
        if not self.cuda:
            raise Skip("skipped: needs CUDA")

    def settle(self) -> None:
        """Everything queued has run, and the allocator has taken back what waited for it."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.empty(1, device=self.device)  # the allocator processes finished events in malloc

    def ids(self, batch: int, seq: int, seed: int) -> torch.Tensor:
        return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(self.device)


CHECKS: list[tuple[str, Callable[[Context], tuple[str, str, bool]]]] = []


def check(name: str):
    def register(fn):
        CHECKS.append((name, fn))
        return fn

    return register


# ---------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of `t`, so that NaN equals NaN and -0.0 differs from 0.0."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN matches any NaN: its payload carries nothing (Triton's
    fp32 -> bf16/fp16 conversion writes the all-ones NaN, torch's the quiet one: 0x7fff vs 0x7fc0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a) if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    same = bits(a) == bits(b)
    return bool(torch.where(nan, torch.isnan(b) if b.is_floating_point() else same, same).all())


def step(model, ids, runtime: PlanRuntime | None = None, micro_batch: int = 0):
    """Loss and gradients of one micro-batch, under `runtime`'s current plan if given."""
    model.zero_grad(set_to_none=True)
    if runtime is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        runtime.micro_batches.running = micro_batch
        with runtime.forward():
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().clone(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def exact(a, b) -> bool:
    return same_bits(a[0], b[0]) and all(same_bits(x, y) for x, y in zip(a[1], b[1]))


def relative_error(grads, reference) -> float:
    num = sum(((g - r).double().norm() ** 2).item() for g, r in zip(grads, reference))
    return math.sqrt(num / sum((r.double().norm() ** 2).item() for r in reference))


def all_offload(model) -> Plan:
    return Plan(dict.fromkeys(bgl.list_ops(model), "offload"))


def model_on(ctx: Context, family: str, dtype=torch.float32, attention: str = "eager"):
    return tiny_model(family, dtype=dtype, attn_implementation=attention).to(ctx.device)


# ---------------------------------------------------------------- kernels


def _e4m3_edges() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours and just above them, at scale 1."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (grid[:-1] + grid[1:]) / 2
    values = torch.cat([grid, mid, torch.nextafter(mid, grid[1:])])
    return torch.cat([values, -values, torch.zeros(1024 - 2 * values.numel())])


def kernel_cases(quick: bool) -> list[tuple[str, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)

    def act(*shape):
        return torch.randn(shape, generator=g) * 10 ** (8 * torch.rand(shape, generator=g) - 4)

    special = act(1000)
    special[[3, 500, 999]], special[17], special[260] = torch.inf, -torch.inf, torch.nan
    lse = torch.cat([act(4, 45).abs() + 3, torch.full((4, 19), torch.inf)], dim=1)  # padded log-sum-exp
    cases = [
        ("7 elements b16", act(7), 16),
        ("3x45 b16", act(3, 45), 16),
        ("5x129 b128", act(5, 129), 128),
        ("9001 b16", act(9001), 16),
        ("zeros b16", torch.zeros(50), 16),
        ("empty", torch.zeros(0, 3), 16),
        ("e4m3 edges b1024", _e4m3_edges(), 1024),
        ("int8 ties b256", torch.cat([torch.arange(-127, 127) + 0.5, torch.tensor([127.0])]), 256),
        ("inf/-inf/nan b16", special, 16),
        ("+inf-padded lse b16", lse, 16),
        ("non-contiguous b16", act(40, 24), 16),  # viewed as .t()[:, ::3] on the device
        ("2^20+3 b128", act((1 << 20) + 3), 128),
        ("5x70001 b65536", act(5, 70001), 2**16),
    ]
    return cases[:11] if quick else cases


def compare_kernels(x: torch.Tensor, block_size: int, fmt: str) -> bool:
    """The dispatching kernels (Triton on CUDA) against the torch reference on the same device."""
    q, r = kernels.quantize(x, block_size, fmt), ref.quantize(x, block_size, fmt)
    return (
        same_bits(q.payload, r.payload)
        and same_bits(q.scales, r.scales)
        and same_bits(kernels.dequantize(r), ref.dequantize(r))
        and same_bits(kernels.dequantize(q), ref.dequantize(r))
    )


@check("kernels: Triton vs reference, bitwise")
def kernels_bitwise(ctx: Context):
    total, wrong = 0, []
    dtypes = (torch.float32, torch.bfloat16) if ctx.quick else (torch.float32, torch.bfloat16, torch.float16)
    for fmt in ref.FORMATS:
        for dtype in dtypes:
            for name, x, block_size in kernel_cases(ctx.quick):
                if dtype == torch.float16 and not torch.isfinite(x.to(dtype)[torch.isfinite(x)]).all():
                    continue  # beyond fp16's range
                total += 1
                x = x.to(dtype).to(ctx.device)
                if name.startswith("non-contiguous"):
                    x = x.t()[:, ::3]  # (moving a strided view to the device would make it contiguous)
                    assert not x.is_contiguous()
                if not compare_kernels(x, block_size, fmt):
                    wrong.append(f"{fmt}/{str(dtype)[6:]}/{name}")
    backend = "triton" if ctx.cuda else "reference (CPU)"
    differ = f"; differ: {', '.join(wrong[:6])}" if wrong else ""
    return f"{backend}: {total - len(wrong)}/{total} equal{differ}", f"{total} cases", not wrong


@check("kernels: non-default stream, producer delayed")
def kernels_stream(ctx: Context):
    ctx.need_cuda()
    side, ok = torch.cuda.Stream(ctx.device), True
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    for fmt in ref.FORMATS:
        expected = ref.quantize(x, 128, fmt)
        side.wait_stream(torch.cuda.current_stream(ctx.device))
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # the copy below lands late: a kernel on another stream reads garbage
            late = x.clone()
            q = kernels.quantize(late, 128, fmt)
            back = kernels.dequantize(q)
        torch.cuda.current_stream(ctx.device).wait_stream(side)
        ok &= same_bits(q.payload, expected.payload) and same_bits(q.scales, expected.scales)
        ok &= same_bits(back, ref.dequantize(expected))
    return "ordered after the producer" if ok else "raced the producer", "2 formats, 1M elements", ok


@check("kernels: tensor on a non-current device")
def kernels_other_device(ctx: Context):
    ctx.need_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip("skipped: 1 GPU")
    other = torch.device("cuda", 1)
    ok = True
    with torch.cuda.device(0):
        for fmt in ref.FORMATS:
            x = torch.randn(100_003, generator=torch.Generator().manual_seed(2)).to(other)
            ok &= compare_kernels(x, 128, fmt)
    return "equal on cuda:1 with cuda:0 current" if ok else "differ", "2 formats", ok


@check("kernels: fp8 below sm_89 falls back")
def kernels_fallback(ctx: Context):
    ctx.need_cuda()
    real = torch.cuda.get_device_capability
    kernels._warned.discard("fp8_e4m3")
    torch.cuda.get_device_capability = lambda device=None: (8, 0)  # an A100, as the dispatch sees it
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = torch.randn(10_000, generator=torch.Generator().manual_seed(3)).to(ctx.device)
            ok = compare_kernels(x, 128, "fp8_e4m3") and compare_kernels(x, 128, "fp8_e4m3")
    finally:
        torch.cuda.get_device_capability = real
    said = [w for w in caught if "compute capability" in str(w.message)]
    cap = ".".join(map(str, real(ctx.device)))
    return f"reference used, {len(said)} warning(s)", f"this GPU: sm {cap}", ok and len(said) == 1


# ---------------------------------------------------------------- offload on streams


def _delay_streams(runtime: PlanRuntime, cycles: int) -> None:
    """Every copy out and back starts late: a missing wait or record_stream shows as wrong bits."""
    pool, original = runtime.hooks.pool, runtime.hooks.pool.stream

    def stream(device, direction):
        s = original(device, direction)
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles)
        return s

    pool.stream = stream


def _nan_churn(runtime: PlanRuntime, device: torch.device, depth: int) -> None:
    """After each pack, NaN-filled tensors as large as the last packed storages take whatever the
    allocator has just freed: a source freed before its copy out has read it comes back NaN."""
    hooks, pack = runtime.hooks, runtime.hooks.pack
    recent: deque[int] = deque(maxlen=depth)
    junk: list[torch.Tensor] = []

    def churn(tensor):
        packed = pack(tensor)
        found = _storage(tensor)
        if found is not None:
            recent.append(found[1])
        junk.clear()
        junk.extend(torch.full((n,), 255, dtype=torch.uint8, device=device) for n in recent)
        return packed

    hooks.pack = churn


@check("offload: delayed side streams + NaN churn")
def offload_delayed(ctx: Context):
    model = model_on(ctx, "qwen3_moe")
    batches = [ctx.ids(2, ctx.seq(64 - 8 * i), seed=i) for i in range(ctx.micro_batches)]
    references = [step(model, ids) for ids in batches]
    reproducible = exact(step(model, batches[0]), references[0]) if ctx.cuda else "n/a"
    runtime = PlanRuntime(model).install()
    try:
        runtime.set_plan(all_offload(model))
        if ctx.cuda:
            _delay_streams(runtime, 2_000_000)
        _nan_churn(runtime, ctx.device, 8 if ctx.cuda else 1)
        results = [step(model, ids, runtime, mb) for mb, ids in enumerate(batches)]
        host = runtime.hooks.pool.made
    finally:
        runtime.remove()
    equal = sum(exact(r, e) for r, e in zip(results, references))
    finite = all(torch.isfinite(g).all() for _, grads in results for g in grads)
    return (f"{equal}/{len(batches)} micro-batches bitwise, grads {'finite' if finite else 'NOT finite'}",
            f"{host} host buffers; baseline reproducible: {reproducible}", equal == len(batches) and finite)


@check("offload: runtime built before .cuda() pins")
def offload_late_cuda(ctx: Context):
    ctx.need_cuda()
    model = tiny_model("qwen3_moe", attn_implementation="eager")
    runtime = PlanRuntime(model).install()  # on CPU: the old code decided "not pinned" here
    try:
        runtime.set_plan(all_offload(model))
        model.to(ctx.device)
        ids = ctx.ids(2, 64, seed=0)
        reference = step(model, ids)
        got = step(model, ids, runtime)
        pool = runtime.hooks.pool
        pinned = [buffer.is_pinned() for free in pool._free.values() for buffer, _ in free]
        device = runtime.ledger.device
    finally:
        runtime.remove()
    ok = exact(got, reference) and pinned and all(pinned) and device == ctx.device
    return f"{sum(pinned)}/{len(pinned)} buffers pinned, ledger on {device}", f"bitwise: {exact(got, reference)}", bool(ok)


@check("offload: host pool stops growing")
def offload_pool(ctx: Context):
    model = model_on(ctx, "glm4_moe")
    runtime = PlanRuntime(model).install()
    made = []
    try:
        runtime.set_plan(all_offload(model))
        for mb in range(6 if ctx.cuda else 3):  # the first micro-batch is the longest; the others vary below it
            seq = 96 if mb == 0 else 60 + 6 * ((mb * 5) % 7)
            step(model, ctx.ids(2, ctx.seq(seq) - (mb > 0) * (mb % 3), seed=10 + mb), runtime, mb)
            made.append(runtime.hooks.pool.made)
        held = runtime.hooks.pool.free_bytes
    finally:
        runtime.remove()
    return f"buffers made per micro-batch: {made}", f"{held / 2**20:.1f} MiB held", made[0] == made[-1]


def _intervals(events, keep) -> list[tuple[float, float, object]]:
    return [(e["ts"], e["ts"] + e.get("dur", 0), (e.get("args") or {}).get("stream")) for e in events if keep(e)]


@check("offload: D2H copies overlap compute")
def offload_overlap(ctx: Context):
    ctx.need_cuda()
    from torch.profiler import ProfilerActivity, profile

    model = model_on(ctx, "qwen3_moe", attention="sdpa")
    ids = ctx.ids(8, 512, seed=4)
    runtime = PlanRuntime(model).install()
    try:
        runtime.set_plan(all_offload(model))
        step(model, ids, runtime)  # warm up: pool, kernels
        ctx.settle()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(model, ids, runtime)
            ctx.settle()
    finally:
        runtime.remove()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    copies = _intervals(events, lambda e: e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", ""))
    kernels_ = _intervals(events, lambda e: e.get("cat") == "kernel")
    if not copies:
        return "no DtoH copy in the trace", f"{len(kernels_)} kernels", False
    overlapped = 0.0
    for start, end, stream in copies:
        for k_start, k_end, k_stream in kernels_:
            if k_stream != stream and k_start < end and k_end > start:
                overlapped += min(end, k_end) - max(start, k_start)
    copy_time = sum(end - start for start, end, _ in copies)
    streams = {s for _, _, s in copies}
    return (f"{len(copies)} DtoH copies on stream(s) {sorted(map(str, streams))}",
            f"{overlapped / max(copy_time, 1e-9):.0%} of copy time under compute kernels", overlapped > 0)


# ---------------------------------------------------------------- ledger and cost model


def _ledger_vs_allocator(ctx: Context, plan_of) -> tuple[int, int]:
    model = model_on(ctx, "qwen3_moe", attention="sdpa")
    ids = ctx.ids(4, 256, seed=5)
    runtime = PlanRuntime(model).install()
    try:
        runtime.set_plan(plan_of(model))
        step(model, ids, runtime)  # warm up: cuBLAS workspaces, pool
        model.zero_grad(set_to_none=True)
        ctx.settle()
        before = torch.cuda.memory_allocated(ctx.device)
        with runtime.forward():
            loss = model(input_ids=ids, labels=ids).loss
        ctx.settle()
        allocated = torch.cuda.memory_allocated(ctx.device) - before
        counted = runtime.ledger.live_device_bytes
        loss.backward()
    finally:
        runtime.remove()
    return counted, allocated


for _plan_name, _plan_of in (("keep", lambda model: Plan()), ("offload", all_offload)):

    def _ledger_check(ctx: Context, plan_of=_plan_of):
        ctx.need_cuda()
        counted, allocated = _ledger_vs_allocator(ctx, plan_of)
        error = abs(counted - allocated) / max(allocated, 1)
        return f"ledger {counted} B, allocator {allocated} B", f"{error:.2%} apart (limit 5%)", error <= 0.05

    check(f"ledger vs memory_allocated: {_plan_name}")(_ledger_check)


@check("ledger: a save past spill_at moves kept activations to the host, bitwise; the allocator frees them")
def ledger_spill(ctx: Context):
    model = model_on(ctx, "qwen3_moe", attention="sdpa")
    ids = ctx.ids(4, ctx.seq(256), seed=6)
    runtime = PlanRuntime(model).install()
    try:
        reference = step(model, ids, runtime)  # keep: every activation on the device (and the warm-up)
        kept = runtime.ledger.peak_device_bytes
        runtime.ledger.spill_at = kept * 6 // 10
        model.zero_grad(set_to_none=True)
        ctx.settle()
        before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        runtime.micro_batches.running = 1
        with runtime.forward():
            loss = model(input_ids=ids, labels=ids).loss
        ctx.settle()
        allocated = torch.cuda.memory_allocated(ctx.device) - before if ctx.cuda else runtime.ledger.live_device_bytes
        counted, spilled = runtime.ledger.live_device_bytes, runtime.ledger.spilled_bytes
        loss.backward()
        got = loss.detach().clone(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    finally:
        runtime.remove()
    error = abs(counted - allocated) / max(allocated, 1)
    return (f"kept {kept} B, spill_at {kept * 6 // 10} B: {spilled} B moved",
            f"ledger {counted} B, allocator {allocated} B ({error:.2%} apart, limit 5%)",
            spilled > 0 and counted <= kept * 6 // 10 and error <= 0.05 and exact(got, reference))


@check("ledger: model's device, allocator peak reset")
def ledger_device(ctx: Context):
    ctx.need_cuda()
    model = model_on(ctx, "qwen3_moe")
    ledger = PlanRuntime(model).ledger
    big = torch.empty(64 << 20, dtype=torch.uint8, device=ctx.device)
    del big
    before = ledger.max_allocated_bytes()
    ledger.reset_peak()  # the peak restarts at what is allocated now (the model, earlier checks' caches)
    peak, now = ledger.max_allocated_bytes(), torch.cuda.memory_allocated(ctx.device)
    return (f"device {ledger.device}", f"peak {before / 2**20:.1f} -> {peak / 2**20:.1f} MiB (allocated {now / 2**20:.1f} MiB)",
            ledger.device == ctx.device and peak == now and before >= now + (64 << 20))


def _cost_rows(
    ctx: Context, dtype, lora: dict | None = None, family: str = "qwen3_moe", autocast=None, **config
) -> tuple[str, str, bool]:
    """The weights in `dtype`; `autocast`: the forwards under autocast to that dtype (the device's
    own autocast policy), None without."""
    model = tiny_model(family, dtype=dtype, attn_implementation="sdpa", **config).to(ctx.device)
    if lora is not None:  # PEFT LoRA (`lora` is its LoraConfig), injected on the device
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora))
    cm = model_cost(model, kind=ForwardKind(autocast={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(autocast)))
    batch, seq = 2, ctx.seq(200)  # not a multiple of 32: the memory-efficient kernel pads its log-sum-exp
    ids = ctx.ids(batch, seq, seed=6)
    errors = {}
    runtime = PlanRuntime(model).install()
    try:
        for name, plan in (("keep", Plan()), ("offload", all_offload(model)), ("fp8", Plan.uniform(bgl.list_ops(model), "fp8"))):
            runtime.set_plan(plan)
            model.zero_grad(set_to_none=True)
            with runtime.forward(), torch.autocast(ctx.device.type, dtype=autocast or dtype, enabled=autocast is not None):
                loss = model(input_ids=ids, labels=ids).loss
            ctx.settle()
            counted = runtime.ledger.live_device_bytes
            predicted = cm.activation_bytes(batch * seq, seq_len=seq, plan=plan)
            errors[name] = (counted - predicted) / predicted
            loss.backward()
    finally:
        runtime.remove()
    worst = max(abs(e) for e in errors.values())
    return ", ".join(f"{k} {v:+.3%}" for k, v in errors.items()), f"max {worst:.3%} (limit 1%)", worst <= 0.01


@check("cost model vs ledger: fp32 sdpa, grouped-query (math kernel on CUDA)")
def cost_fp32(ctx: Context):
    return _cost_rows(ctx, torch.float32)


@check("cost model vs ledger: fp32 sdpa, one kv head per head (memory-efficient kernel on CUDA)")
def cost_fp32_mha(ctx: Context):
    return _cost_rows(ctx, torch.float32, num_key_value_heads=4)


@check("cost model vs ledger: bf16 sdpa")
def cost_bf16(ctx: Context):
    return _cost_rows(ctx, torch.bfloat16)


@check("cost model vs ledger: bf16 sdpa, PEFT LoRA with dropout (a bool mask on CUDA)")
def cost_lora(ctx: Context):
    return _cost_rows(ctx, torch.bfloat16, lora=dict(r=4, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


@check("cost model vs ledger: bf16 autocast over bf16 weights (TRL's bf16=True), DeepSeek-V3's FP32 router, PEFT LoRA")
def cost_autocast(ctx: Context):
    lora = dict(r=4, lora_dropout=0.1, target_modules=["q_b_proj", "kv_b_proj"])
    return _cost_rows(ctx, torch.bfloat16, lora=lora, family="deepseek_v3", autocast=torch.bfloat16)


@check("cost model vs ledger: bf16 autocast over fp32 weights (standard mixed precision), GLM-4-MoE, PEFT LoRA")
def cost_mixed_precision(ctx: Context):
    lora = dict(r=4, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return _cost_rows(ctx, torch.float32, lora=lora, family="glm4_moe", autocast=torch.bfloat16)


# ---------------------------------------------------------------- quantised plans


@check("all ops fp8 / int8 within CPU tolerances")
def quantised_all_ops(ctx: Context):
    rows, ok = [], True
    for family in ctx.families:
        for dtype in ctx.dtypes:
            model = model_on(ctx, family, dtype=dtype)
            ids = ctx.ids(2, ctx.seq(48), seed=7)
            reference = step(model, ids)
            runtime = PlanRuntime(model).install()
            try:
                runtime.set_plan(Plan.uniform(bgl.list_ops(model), "fp8"))
                fp8 = step(model, ids, runtime)
                runtime.options = MitigationOptions(quant_format="int8")
                runtime.hooks.options = runtime.options
                int8 = step(model, ids, runtime)
            finally:
                runtime.remove()
            e8, ei = relative_error(fp8[1], reference[1]), relative_error(int8[1], reference[1])
            good = e8 <= FP8_ALL_OPS and ei <= INT8_ALL_OPS and math.isfinite(e8) and math.isfinite(ei)
            ok &= good
            rows.append((f"{family}/{str(dtype)[6:]}", e8, ei, good))
    worst8, worsti = max(r[1] for r in rows), max(r[2] for r in rows)
    bad = [r[0] for r in rows if not r[3]]
    return (f"{len(rows) - len(bad)}/{len(rows)} within" + (f"; over: {', '.join(bad)}" if bad else ""),
            f"worst fp8 {worst8:.2%} (<= {FP8_ALL_OPS:.1%}), int8 {worsti:.2%} (<= {INT8_ALL_OPS:.1%})", ok)


@check("fp8 attn_core, fp32 sdpa model: finite")
def attn_core_fp32(ctx: Context):
    # fp32 without grouped-query attention: on CUDA the memory-efficient kernel, log-sum-exp +inf-padded
    model = tiny_model("qwen3_moe", attn_implementation="sdpa", num_key_value_heads=4).to(ctx.device)
    ids = ctx.ids(2, ctx.seq(48), seed=8)
    reference = step(model, ids)
    layers = {op.layer for op in bgl.list_ops(model) if op.name == "attn_core"}
    results = {}
    runtime = PlanRuntime(model).install()
    try:
        runtime.set_plan(Plan({OpId(layer, "attn_core"): "fp8" for layer in layers}))
        for fmt in ref.FORMATS:
            runtime.options = runtime.hooks.options = MitigationOptions(quant_format=fmt)
            loss, grads = step(model, ids, runtime)
            finite = all(torch.isfinite(g).all() for g in grads)
            results[fmt] = (finite, relative_error(grads, reference[1]))
    finally:
        runtime.remove()
    ok = all(f for f, _ in results.values())  # the error is reported: SDPA's log-sum-exp is quantised too
    return (", ".join(f"{k}: {'finite' if f else 'NOT finite'}" for k, (f, _) in results.items()),
            "grad error " + ", ".join(f"{k} {e:.2%}" for k, (_, e) in results.items()), ok)


# ---------------------------------------------------------------- expert parallelism


@check("expert parallelism: a group of one (NCCL on CUDA, gloo on CPU)")
def expert_parallel_group_of_one(ctx: Context):
    """The EP code path (dispatch, local experts, combine, gate at dispatch) over a real process
    group of this one device: with one rank every expert sees the same rows as without EP, so
    loss and gradients must be bitwise; the Ledger must equal the EP cost model."""
    from datetime import timedelta

    import torch.distributed as dist

    from bagualu_plugin.adapters.gate import GateMonitor
    from bagualu_plugin.parallel.launch import free_port

    port = free_port()
    backend = "nccl" if ctx.cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60), device_id=ctx.device if ctx.cuda else None)
    try:
        ids = ctx.ids(2, ctx.seq(64), seed=9)
        plain = model_on(ctx, "glm4_moe")
        plain.set_experts_implementation("bagualu")
        reference = step(plain, ids)
        model = model_on(ctx, "glm4_moe")
        model.set_experts_implementation("bagualu")
        bgl.expert_parallel(model)
        cm = model_cost(model)
        moe = cm.moe_layers
        runtime = PlanRuntime(model).install()
        errors = []
        try:
            for plan in (Plan(), Plan({OpId(i, n): "recompute" for i in moe for n in ("expert_fc1", "expert_act", "expert_fc2")})):
                runtime.set_plan(plan)
                model.zero_grad(set_to_none=True)
                with GateMonitor(model) as monitor, runtime.forward():
                    loss = model(input_ids=ids, labels=ids.clone()).loss
                ctx.settle()
                pairs = monitor.local_pairs()
                predicted = cm.activation_bytes(ids.numel(), [pairs[i] for i in moe], ids.shape[1], plan)
                errors.append(runtime.ledger.live_device_bytes - predicted)
                loss.backward()
                same = exact(reference, (loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]))
                errors.append(0 if same else 1)
        finally:
            runtime.remove()
    finally:
        dist.destroy_process_group()
    return (f"{backend}: keep and experts recomputed, loss and grads {'bitwise' if not errors[1] + errors[3] else 'DIFFER'}",
            f"ledger - cost model: {errors[0]} B, {errors[2]} B", not any(errors))


# ---------------------------------------------------------------- the Trainer's sharding engines

# DeepSpeed's reduce bucket as the Trainer's and accelerate's example configs size it ("auto": hidden size
# squared); its default (500 M elements, 2 GB in FP32) would dwarf a tiny model's activations
ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
ENGINES = {  # the Trainer's own arguments for each engine, on one process
    "FSDP2": {"fsdp": True, "fsdp_config": {"fsdp_version": 2}},
    **{f"ZeRO-{stage}": {"deepspeed": {**ZERO, "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"}}} for stage in (2, 3)},
}
SHARE = 0.93  # each engine's capacity: this share of the peak the plugin counts for the same run unplanned
AMPLE = 2**40  # a capacity at which nothing is planned


def _engine_run(ctx: Context, engine: str, callback, workdir: str):
    """SFTTrainer on a tiny Qwen3-MoE (FP32, eager attention, seeded) under `engine`, `callback`
    given (None: the Trainer alone); returns the per-step losses, the trainer, and whether the
    engine really ran (FSDP2: the weights are DTensors; ZeRO: DeepSpeed's engine at that stage,
    which at 3 partitioned the weights)."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from bagualu_plugin.adapters.tiny import tiny_tokenizer

    AcceleratorState._reset_state(reset_partial_state=False)  # each Trainer reads its own engine
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", attn_implementation="eager")
    texts = [" ".join(["tokens of a short training text"] * (1 + i % 4)) for i in range(16)]
    args = SFTConfig(
        output_dir=workdir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, max_length=32,
        logging_steps=1, report_to=[], save_strategy="no", gradient_checkpointing=False, bf16=False, seed=0,
        use_cpu=not ctx.cuda, disable_tqdm=True, **ENGINES[engine],
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tiny_tokenizer(), callbacks=[callback] if callback else [])
    trainer.train()
    weights = [p for p in trainer.model_wrapped.parameters()]
    if engine == "FSDP2":
        on = trainer.is_fsdp_enabled and any(type(p).__name__ == "DTensor" for p in weights)
    else:
        stage = ENGINES[engine]["deepspeed"]["zero_optimization"]["stage"]
        on = (trainer.is_deepspeed_enabled and trainer.model_wrapped.zero_optimization_stage() == stage
              and (stage < 3 or any(hasattr(p, "ds_id") for p in weights)))
    return [r["loss"] for r in trainer.state.log_history if "loss" in r], trainer, on


@check("HF Trainer under FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 (one process)")
def trainer_engines(ctx: Context):
    """SFTTrainer with `BagualuCallback` under each sharding engine, on one GPU (a process group of
    one: the Trainer shards over it as over many): the engine really on; the plugin at ample
    capacity (nothing planned) counts the run's peak, its static bytes priced for the engine; at 93%
    of that peak plans are in force, the peak stays at or under the capacity, no cost-model miss,
    and losses are bitwise the same Trainer's without the plugin. On CPU the Trainer's FSDP2
    arguments get DDP from accelerate: there the FSDP2 run goes as far as that and the check is
    skipped (CI runs ZeRO under the Trainer on CPU through `accelerate launch`: tests/test_deepspeed.py)."""
    import importlib.util

    from bagualu_plugin.integrations.transformers import BagualuCallback
    from bagualu_plugin.parallel.launch import free_port

    launched = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in launched}
    os.environ.update(launched)
    results, figures, ok = [], [], True
    try:
        for engine in ENGINES:
            if engine.startswith("ZeRO") and (not ctx.cuda or importlib.util.find_spec("deepspeed") is None):
                results.append(f"{engine}: skipped ({'needs CUDA' if not ctx.cuda else 'deepspeed is not installed'})")
                continue
            with tempfile.TemporaryDirectory() as workdir:
                stock, _, on = _engine_run(ctx, engine, None, workdir)
                if not on:
                    if ctx.cuda:
                        raise AssertionError(f"{engine}: the Trainer did not shard the model")
                    raise Skip(f"skipped: on CPU the Trainer runs no {engine} (accelerate shards only on accelerator devices)")
                runs, same = {}, True
                for name, capacity in (("ample", AMPLE), ("planned", None)):
                    capacity = capacity or int(SHARE * runs["ample"].peak_device_bytes)
                    recipe = {"hardware": {"capacity_bytes": capacity}, "strategies": {"allowed": ["recompute", "offload"]}}
                    callback = BagualuCallback(recipe)
                    losses, _, _ = _engine_run(ctx, engine, callback, workdir)
                    runs[name], same = callback.provisioner, same and losses == stock
            unplanned, prov = runs["ample"].peak_device_bytes, runs["planned"]
            events = [*runs["ample"].events, *prov.events]
            plans, misses = sum(bool(e.plan) for e in prov.events), sum(len(e.misses) for e in events)
            good = same and prov.peak_device_bytes <= capacity < unplanned and plans and not misses
            ok &= good
            results.append(f"{engine}: losses {'bitwise' if same else 'DIFFER'}, {plans} plans, {misses} misses")
            figures.append(f"{engine} peak {prov.peak_device_bytes} <= {capacity} < {unplanned} B: {good}")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return "; ".join(results), "; ".join(figures), ok


@check("HF Trainer under accelerate launch --config_file: FSDP2 and ZeRO-3 plugins (examples/sft_moe.py)")
def trainer_engines_launched(ctx: Context):
    """The other way to enable an engine: accelerate's config file, the example launched on this
    GPU as a user launches it. Per engine: the run without the plugin; the plugin at ample capacity
    (its peak); the plugin at 93% of that peak: losses and saved weights bitwise the first run's,
    the peak at or under the capacity, plans in force, no cost-model miss, and the recipe the
    callback derived prices the engine (`budget.fsdp`: everything sharded). Needs CUDA: on CPU
    accelerate runs no FSDP2 (DeepSpeed's launch is tested there: tests/test_deepspeed.py)."""
    import importlib.util
    import json
    from pathlib import Path

    from bagualu_plugin.adapters.tiny import save_tiny, tiny_tokenizer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from helpers import accelerate_config, launch_example  # the tests' launch of the example, shared

    ctx.need_cuda()
    results, figures, ok = [], [], True
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model, corpus = save_tiny("qwen3_moe", workdir / "model"), workdir / "corpus.txt"
        tiny_tokenizer().save_pretrained(model)
        corpus.write_text("\n".join(" ".join(["tokens of a short training text"] * (1 + i % 4)) for i in range(16)))
        common = ("--model", str(model), "--data", str(corpus), "--steps", "3", "--accumulation", "2", "--max-length", "32",
                  "--attn-implementation", "eager", "--deterministic")
        hidden = tiny_config("qwen3_moe").hidden_size  # accelerate's plugin fills no "auto" bucket size: the Trainer's rule
        for engine in ("FSDP2", "ZeRO-3"):
            if engine.startswith("ZeRO") and importlib.util.find_spec("deepspeed") is None:
                results.append(f"{engine}: skipped (deepspeed is not installed)")
                continue
            config = accelerate_config(workdir, 1, None if engine == "FSDP2" else {"stage": 3, "reduce_bucket_size": hidden * hidden})
            stock, _, theirs = launch_example(config, workdir / f"{engine}-stock", *common, "--no-plugin", timeout_s=240)
            _, ample, _ = launch_example(config, workdir / f"{engine}-ample", *common, "--capacity", str(AMPLE), timeout_s=240)
            capacity, out = int(SHARE * ample["bagualu/peak_device_bytes"]), workdir / engine
            ours, record, mine = launch_example(config, out, *common, "--capacity", str(capacity), timeout_s=240)
            budget = json.loads((out / "recipe-rank0.json").read_text())["budget"]
            same = ours == stock and mine.keys() == theirs.keys() and all(
                same_bits(mine[f][k], theirs[f][k]) for f in theirs for k in theirs[f])
            misses = ample["bagualu/cost_model_misses"] + record["bagualu/cost_model_misses"]
            good = (same and budget["fsdp"] and record["bagualu/peak_device_bytes"] <= capacity < ample["bagualu/peak_device_bytes"]
                    and record["bagualu/mitigated_ops"] > 0 and not misses and record.get("bagualu/spilled_bytes", 0) == 0)
            ok &= good
            results.append(f"{engine}: losses and weights {'bitwise' if same else 'DIFFER'}, {record['bagualu/mitigated_ops']} ops "
                           f"mitigated, {misses} misses, priced fully sharded: {budget['fsdp']}")
            figures.append(f"{engine} peak {record['bagualu/peak_device_bytes']} <= {capacity} < {ample['bagualu/peak_device_bytes']} B")
    return "; ".join(results), "; ".join(figures), ok


# ---------------------------------------------------------------- driver


def _environment(ctx: Context) -> str:
    try:
        import transformers

        tf = transformers.__version__
    except Exception:  # noqa: BLE001 - informational only
        tf = "?"
    try:
        import triton

        tr = triton.__version__
    except Exception:  # noqa: BLE001
        tr = "none"
    gpu = "CPU"
    if ctx.cuda:
        sm = ".".join(map(str, torch.cuda.get_device_capability(ctx.device)))
        gpu = f"{torch.cuda.get_device_name(ctx.device)} sm {sm}, {torch.cuda.device_count()} GPU(s)"
    return f"torch {torch.__version__}, transformers {tf}, triton {tr}, python {platform.python_version()}; {gpu}"


class _Timeout(Exception):
    pass


def _run(name, fn, ctx: Context, limit: int) -> list[str]:
    start = time.perf_counter()

    def expire(*_):
        raise _Timeout(f"over {limit} s")

    use_alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if use_alarm:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(limit)
    try:
        result, figure, ok = fn(ctx)
        status = "PASS" if ok else "FAIL"
    except Skip as skipped:
        result, figure, status = str(skipped), "", "SKIP"
    except BaseException as error:  # noqa: BLE001 - every failure is a row; the next check runs
        if isinstance(error, KeyboardInterrupt):
            raise
        last = traceback.extract_tb(error.__traceback__)[-1]
        result = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160] if str(error).strip() else ''}"
        figure, status = f"at {os.path.basename(last.filename)}:{last.lineno}", "FAIL"
        traceback.print_exc(file=sys.stderr)
    finally:
        if use_alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        if ctx.cuda:
            try:
                torch.cuda.synchronize(ctx.device)
            except Exception:  # noqa: BLE001 - a broken context shows in the next rows
                pass
    seconds = time.perf_counter() - start
    print(f"[{status}] {name}: {result} | {figure} ({seconds:.1f} s)", flush=True)
    return [name, result, figure, status]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two families, fewer kernel cases")
    p.add_argument("--cpu", action="store_true", help="reduced mode on CPU (taken anyway without CUDA)")
    p.add_argument("--only", default="", help="run only checks whose name contains this text")
    p.add_argument("--skip", default=None, help="leave out checks whose name contains this text")
    p.add_argument("--check-timeout", type=int, default=300, help="seconds per check")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    ctx = Context(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"), args.quick)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if cuda:
        torch.use_deterministic_algorithms(True, warn_only=True)
        warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
    started = time.perf_counter()
    rows = [["environment", _environment(ctx), "cuda" if cuda else "reduced CPU mode", "INFO"]]
    try:
        for name, fn in CHECKS:
            if args.only in name and not (args.skip and args.skip in name):
                rows.append(_run(name, fn, ctx, args.check_timeout))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    failed = sum(r[3] == "FAIL" for r in rows)
    text = table(["check", "result", "figure", "status"], rows)
    passed, skipped = sum(r[3] == "PASS" for r in rows), sum(r[3] == "SKIP" for r in rows)
    text += f"\n\n{len(rows) - 1} checks: {passed} pass, {failed} fail, {skipped} skipped in {time.perf_counter() - started:.0f} s"
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "gpu_check.txt"), "w") as f:
            f.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
