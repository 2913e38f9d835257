"""Blockwise FP8 / int8 quantisation of saved activations: Triton kernels and torch references.

The "fp8" mitigation (paper §IV-B) stores a saved activation as a `Quantized` (one byte per element
plus one FP32 scale per block) and restores it before backward. `quantize` / `dequantize` run the
Triton kernels on CUDA tensors when triton imports, and the torch reference elsewhere; both give
the same bits. `triton_quant` is imported only then, because triton chooses between compiling and
interpreting (TRITON_INTERPRET=1) when a kernel is defined, not when it runs. Triton has fp8 e4m3
only from compute capability 8.9 (H100, L40, RTX 40): below it (A100) fp8 uses the torch
reference, with one warning, and int8 keeps the Triton kernels.
"""

from __future__ import annotations

import warnings

import torch

from . import reference
from .reference import FORMATS, Quantized, check_block_size

__all__ = ["FORMATS", "Quantized", "dequantize", "quantize", "stored_nbytes"]


_warned: set[str] = set()


def _backend(tensor: object, fmt: object):
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        from . import triton_quant

        if triton_quant.HAVE_TRITON:
            if fmt != "fp8_e4m3" or torch.cuda.get_device_capability(tensor.device) >= (8, 9):
                return triton_quant
            if fmt not in _warned:  # Triton has no e4m3 below sm_89 (A100): every fp8 save would raise
                _warned.add(fmt)
                warnings.warn(
                    f"{torch.cuda.get_device_name(tensor.device)} (compute capability < 8.9) has no fp8 e4m3 in Triton: "
                    "fp8 saved activations use the torch reference kernels (same bits, slower); "
                    "quant_format='int8' keeps the Triton kernels",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return reference


def quantize(x: torch.Tensor, block_size: int = 128, fmt: str = "fp8_e4m3") -> Quantized:
    """Quantise `x` (fp32, bf16 or fp16, any shape and strides) in blocks of `block_size` elements
    to `fmt` ("fp8_e4m3" or "int8")."""
    return _backend(x, fmt).quantize(x, block_size, fmt)


def dequantize(q: Quantized) -> torch.Tensor:
    """The tensor `q` was quantised from, in its dtype and shape, up to the format's rounding."""
    quantized = isinstance(q, Quantized)
    return _backend(q.payload if quantized else None, q.fmt if quantized else None).dequantize(q)


def stored_nbytes(numel: int, block_size: int) -> int:
    """Bytes of a stored `Quantized` of `numel` elements in either format: one byte per element
    plus one FP32 scale per block (the cost model's `fp8_stored_bytes`)."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    check_block_size(block_size)
    return numel + 4 * -(-numel // block_size)
