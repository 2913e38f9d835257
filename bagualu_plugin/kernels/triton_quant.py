"""Triton kernels for blockwise quantisation of saved activations (paper §IV-B): the quantize in
forward and the dequantize before backward are memory-bound casts, so each is one pass over the
tensor in one launch, with results bit-identical to `reference` on a GPU.

One program handles ROWS consecutive blocks as a [ROWS, block_size] tile (ROWS * block_size =
TILE elements, or one block when block_size > TILE); masks cover the partial last block and the
rows past the end. Bit-exactness rests on using only correctly rounded fp32 operations:
`div_rn` (Triton's `/` is an approximate division on NVIDIA GPUs), a round-half-to-even built from
`floor` (libdevice `rint` does not run in the interpreter), clamps before the casts, and the
e4m3 cast, which rounds to nearest even on the GPU. Under TRITON_INTERPRET=1 that cast is wrong
for some values (docs/architecture.md) and fp32 -> bf16 truncates; int8 payloads, scales and fp32 /
fp16 outputs are bit-exact there too.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from .reference import QMAX, QMAX_SPECIAL, SPECIAL, STORAGE, Quantized, check_args, check_quantized

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: the package falls back to the torch reference
    triton = None
HAVE_TRITON = triton is not None
# triton compiles or interprets a kernel depending on TRITON_INTERPRET when the kernel is defined
# (read through `triton.knobs` from triton 3.4 on).
INTERPRETED = HAVE_TRITON and (
    bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else os.environ.get("TRITON_INTERPRET") == "1"
)

TILE = 4096  # elements per program: enough bytes in flight per launch, few programs in the interpreter


def _require_triton(device: torch.device) -> None:
    if not HAVE_TRITON:
        raise ImportError("the Triton kernels need `triton` (pip install 'bagualu-plugin[triton]')")
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the Triton kernels run on CUDA tensors, got a tensor on {device}; to run them on CPU set "
            "TRITON_INTERPRET=1 before bagualu_plugin.kernels.triton_quant is imported"
        )


def _on(device: torch.device):
    """Triton launches on the current device's current stream: make that the tensor's device, so a
    tensor on cuda:1 with cuda:0 current runs there, ordered after the work that made it."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _launch(n: int, block_size: int) -> tuple[tuple[int], dict]:
    """Grid and tile of a launch over `n` elements; warps grow with the tile (one block can exceed
    TILE), keeping ~256 elements per thread at most. Not tuned on hardware yet."""
    rows = max(1, TILE // block_size)
    grid = (triton.cdiv(triton.cdiv(n, block_size), rows),)
    return grid, dict(BLOCK=block_size, ROWS=rows, num_warps=max(4, min(16, rows * block_size // 1024)))


if HAVE_TRITON:

    @triton.jit
    def _round_half_even(v):
        f = tl.floor(v)
        d = v - f  # exact for |v| < 2**23
        odd = (f.to(tl.int32) & 1) == 1
        return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, s_ptr, n, n_blocks, QMAX: tl.constexpr, QMAX_SPECIAL: tl.constexpr,
                         POS: tl.constexpr, NEG: tl.constexpr, INT8: tl.constexpr,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        finite = (x == x) & (tl.abs(x) != float("inf"))
        special = tl.max(tl.where(finite, 0, 1), axis=1) == 1
        qmax = tl.where(special, QMAX_SPECIAL, QMAX)
        scale = tl.math.div_rn(tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1), qmax)
        scale = tl.where(scale == 0.0, 1.0, scale)
        tl.store(s_ptr + rows, tl.where(special, -scale, scale), mask=rows < n_blocks)
        v = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (ROWS, BLOCK)))
        v = tl.minimum(tl.maximum(v, -qmax[:, None]), qmax[:, None])
        if INT8:
            v = _round_half_even(v)
            v = tl.where(finite, v, tl.where(x == float("inf"), POS, tl.where(x == float("-inf"), NEG, -128.0)))
            q = v.to(tl.int8)
        else:
            v = tl.where(finite, v, tl.where(x == float("inf"), POS, tl.where(x == float("-inf"), NEG, float("nan"))))
            q = v.to(tl.float8e4nv)
        tl.store(q_ptr + offs, q, mask=mask)

    @triton.jit
    def _dequantize_kernel(q_ptr, s_ptr, y_ptr, n, POS: tl.constexpr, NEG: tl.constexpr, INT8: tl.constexpr,
                           BLOCK: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < n
        scale = tl.load(s_ptr + rows, mask=rows * BLOCK < n, other=1.0)
        v = tl.load(q_ptr + offs, mask=mask).to(tl.float32)
        y = v * tl.abs(scale)[:, None]
        marked = (scale < 0.0)[:, None]
        y = tl.where(marked & (v == POS), float("inf"), y)
        y = tl.where(marked & (v == NEG), float("-inf"), y)
        if INT8:
            y = tl.where(marked & (v == -128.0), float("nan"), y)
        else:
            y = tl.where(marked & (v != v), float("nan"), y)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def quantize(x: torch.Tensor, block_size: int = 128, fmt: str = "fp8_e4m3") -> Quantized:
    """Triton version of `reference.quantize` (same arguments, same result)."""
    check_args(x, block_size, fmt)
    _require_triton(x.device)
    flat = x.contiguous().view(-1)
    n = flat.numel()
    payload = torch.empty(n, dtype=STORAGE[fmt], device=x.device)
    scales = torch.empty(-(-n // block_size), dtype=torch.float32, device=x.device)
    if n:
        grid, meta = _launch(n, block_size)
        pos, neg, _ = SPECIAL[fmt]
        with _on(x.device):
            _quantize_kernel[grid](flat, payload, scales, n, scales.numel(), QMAX=QMAX[fmt], QMAX_SPECIAL=QMAX_SPECIAL[fmt],
                                   POS=pos, NEG=neg, INT8=fmt == "int8", **meta)
    return Quantized(payload, scales, x.shape, x.dtype, block_size, fmt)


def dequantize(q: Quantized) -> torch.Tensor:
    """Triton version of `reference.dequantize`."""
    check_quantized(q)
    _require_triton(q.payload.device)
    n = q.payload.numel()
    out = torch.empty(n, dtype=q.dtype, device=q.payload.device)
    if n:
        grid, meta = _launch(n, q.block_size)
        pos, neg, _ = SPECIAL[q.fmt]
        with _on(out.device):
            _dequantize_kernel[grid](q.payload, q.scales, out, n, POS=pos, NEG=neg, INT8=q.fmt == "int8", **meta)
    return out.view(q.shape)
