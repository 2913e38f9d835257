"""The roofline of a mitigation strategy (paper §IV-B, Fig. 6).

Mitigation bandwidth = bytes of activation memory saved per second of added time, plotted against
the size of the activation. Below the knee size S it is bound by a fixed launch cost; above it it
saturates at the peak B. With launch cost t0, S = B * t0 and

    bandwidth(s) = min(B, s / t0),        time(s) = max(t0, s / B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..hardware import HardwareSpec
from .symbolic import Sym


@dataclass(frozen=True)
class Roofline:
    launch_s: float
    peak: float  # bytes per second

    @property
    def knee(self) -> float:
        """S: the size at which the launch cost stops dominating."""
        return self.peak * self.launch_s

    def time(self, size: float) -> float:
        if isinstance(size, Sym):  # a form of the shape: its time is a variable of the shape too
            return size.apply(self.times)
        return max(self.launch_s, size / self.peak) if size > 0 else 0.0

    def times(self, sizes: np.ndarray) -> np.ndarray:
        """`time` of many sizes at once."""
        return np.where(sizes > 0, np.maximum(self.launch_s, sizes / self.peak), 0.0)

    def bandwidth(self, size: float) -> float:
        return size / self.time(size) if size > 0 else 0.0


def crossover(i: Roofline, j: Roofline) -> float | None:
    """Size below which strategy i (lower peak, B_i < B_j) saves memory faster than j, or None
    when one strategy is at least as fast at every size.

    i wins small sizes only if it launches faster (S_i / B_i < S_j / B_j); the two bandwidths then
    meet where i is flat at B_i and j still rises as s * B_j / S_j, at s = S_j * B_i / B_j. The
    paper prints this point as S_i * B_j / B_i, the same expression with the labels exchanged.
    """
    if i.peak > j.peak:
        i, j = j, i
    if i.peak == j.peak or i.launch_s >= j.launch_s:
        return None
    return j.knee * i.peak / j.peak


def offload_copy(hw: HardwareSpec) -> Roofline:
    """One device<->host copy: bytes moved per second over the host link."""
    return Roofline(hw.copy_launch_s, hw.host_link_bandwidth)


def cast_kernel(hw: HardwareSpec) -> Roofline:
    """One FP8 quantize or dequantize: bytes read + written per second, as measured for the
    hardware's cast kernels or, by default, a memory-bound kernel at HBM bandwidth."""
    return Roofline(hw.cast_launch_s or hw.kernel_launch_s, hw.cast_bandwidth or hw.hbm_bandwidth)


def fp8_stored_bytes(elements: float, block_size: int) -> float:
    """FP8 e4m3 payload (1 byte per element) plus one FP32 scale per block."""
    return elements + 4 * math.ceil(elements / block_size)


def offload_roofline(hw: HardwareSpec) -> Roofline:
    """Offload saves s bytes for a copy out in forward and a copy back in backward."""
    copy = offload_copy(hw)
    return Roofline(2 * copy.launch_s, copy.peak / 2)


def fp8_roofline(hw: HardwareSpec, dtype_bytes: int, block_size: int) -> Roofline:
    """FP8 storage of a tensor of `dtype_bytes` elements: saves a fraction (1 - r) of its bytes,
    r = (1 + 4 / block) / dtype_bytes, for a quantize (read s, write r s) in forward and a
    dequantize in backward."""
    r = (1 + 4 / block_size) / dtype_bytes
    cast = cast_kernel(hw)
    return Roofline(2 * cast.launch_s / (1 - r), cast.peak * (1 - r) / (2 * (1 + r)))
