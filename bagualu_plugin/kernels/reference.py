"""Torch reference of blockwise quantisation of saved activations (paper §IV-B: "quantization casts
the activation to a lower precision for storage and casts it back before use").

The tensor is flattened and cut into blocks of `block_size` elements (the last one may be
partial); each block keeps one FP32 scale, amax(|x|) / QMAX, so one outlier only costs precision
inside its own block (per-tensor scales gave ~5e-2 gradient error, docs/architecture.md). Stored
bytes are one per element plus four per block, the cost model's `fp8_stored_bytes`.

Scale convention: where amax / QMAX is zero (an all-zero block, or an FP32 amax below ~1e-43 whose
quotient underflows) the scale is 1.0, so the block stores zeros and dequantises to zeros.

Non-finite values come back exactly. Saved tensors can hold them: the memory-efficient SDPA kernel
of CUDA pads its log-sum-exp with +inf, masks hold -inf. A scale taken over them would be inf and
turn every value of the block into 0 * inf = NaN. So the amax is taken over finite values only, and
a block that holds a non-finite value is marked by a negative scale: its finite values use the
narrower grid QMAX_SPECIAL, which frees the codes SPECIAL for +inf, -inf and NaN. Blocks without
one are unchanged, and no check needs a device sync.

Every step is an IEEE-rounded fp32 operation (true divisions by tensors, not multiplications by a
reciprocal, which torch uses on CUDA for a Python-scalar divisor), so the Triton kernels can match
these results bit for bit. These functions run on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("fp8_e4m3", "int8")
# Largest magnitude of each format, and the storage dtype. int8 uses +-127 so the grid is symmetric.
QMAX = {"fp8_e4m3": 448.0, "int8": 127.0}
STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
# Grid of the finite values of a block holding a non-finite one, and the codes (as the payload reads
# in fp32) of +inf, -inf and NaN there: fp8 +-448 and its own NaN, int8 +-127 and -128.
QMAX_SPECIAL = {"fp8_e4m3": 416.0, "int8": 126.0}
SPECIAL = {"fp8_e4m3": (448.0, -448.0, float("nan")), "int8": (127.0, -127.0, -128.0)}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One block is one tile row of the Triton kernels; larger scale blocks save < 0.01% more bytes.
MAX_BLOCK_SIZE = 2**16


@dataclass(frozen=True)
class Quantized:
    """A quantised activation: 1-D `payload` (one element per input element) and one FP32 scale
    per block, plus what is needed to restore the original tensor."""

    payload: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_size: int
    fmt: str

    @property
    def nbytes(self) -> int:
        """Bytes held while stored: payload plus scales (what the Ledger and cost model count)."""
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * self.scales.element_size()


def check_block_size(block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if not 16 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [16, {MAX_BLOCK_SIZE}], got {block_size}")


def check_args(x: object, block_size: object, fmt: object) -> None:
    """Raise a TypeError / ValueError naming the offending argument."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must be a float32, bfloat16 or float16 tensor, got {x.dtype}")
    check_block_size(block_size)
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def check_quantized(q: object) -> None:
    if not isinstance(q, Quantized):
        raise TypeError(f"q must be a Quantized, got {type(q).__name__}")


def quantize(x: torch.Tensor, block_size: int = 128, fmt: str = "fp8_e4m3") -> Quantized:
    """Blockwise scale and round-to-nearest-even, saturating cast of `x` to `fmt`."""
    check_args(x, block_size, fmt)
    flat = x.contiguous().view(-1).float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, -n % block_size)).view(-1, block_size)
    finite = torch.isfinite(blocks)
    special = ~finite.all(dim=1)
    amax = torch.where(finite, blocks.abs(), torch.zeros_like(blocks)).amax(dim=1)
    qmax = torch.where(special, QMAX_SPECIAL[fmt], QMAX[fmt])
    scales = amax / qmax
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    scaled = torch.minimum(torch.maximum(blocks / scales[:, None], -qmax[:, None]), qmax[:, None])
    if fmt == "int8":
        scaled = scaled.round()  # half to even; the clamp above made the int8 cast exact
    pos, neg, nan = SPECIAL[fmt]
    scaled = torch.where(finite, scaled, torch.where(blocks == torch.inf, pos, torch.where(blocks == -torch.inf, neg, nan)))
    scales = torch.where(special, -scales, scales)
    return Quantized(scaled.view(-1)[:n].to(STORAGE[fmt]), scales, x.shape, x.dtype, block_size, fmt)


def dequantize(q: Quantized) -> torch.Tensor:
    """payload * scale in FP32 (the special codes of a marked block back to inf, -inf, NaN), cast
    back to the original dtype and shape."""
    check_quantized(q)
    n = q.payload.numel()
    values = torch.nn.functional.pad(q.payload.float(), (0, -n % q.block_size)).view(-1, q.block_size)
    out = values * q.scales.abs()[:, None]
    pos, neg, nan = SPECIAL[q.fmt]
    marked = (q.scales < 0)[:, None]
    out = torch.where(marked & (values == pos), torch.inf, out)
    out = torch.where(marked & (values == neg), -torch.inf, out)
    out = torch.where(marked & ((values == nan) | values.isnan()), torch.nan, out)
    return out.view(-1)[:n].to(q.dtype).view(q.shape)
