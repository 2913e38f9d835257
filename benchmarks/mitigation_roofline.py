"""The roofline of each mitigation strategy on this machine (paper §IV-B, Fig. 6).

For activation sizes from 4 KiB to 64 MiB, time what each strategy adds to one forward and one
backward, the way the runtime does it (`bagualu_plugin.runtime.storage`):

- offload: copy the storage out (host buffer; pinned and on a side stream on CUDA) and back;
- fp8 / int8: blockwise quantise (block 128) and dequantise (`bagualu_plugin.kernels`);

then report the mitigation bandwidth (bytes saved per second of added time) and fit the knee
(S, B): B is the plateau (median bandwidth of the largest sizes), the launch cost t0 the time
at the smallest size, S = B * t0. The same script runs unchanged on a GPU (tensors on cuda).
The `cpu` hardware preset carries the knees measured here (hardware.py).

    python benchmarks/mitigation_roofline.py [--device cpu|cuda] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bagualu_plugin import kernels
from bagualu_plugin.report import table
from bagualu_plugin.units import fmt_bytes, fmt_seconds

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm up (allocator, kernel compilation)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def offload(x: torch.Tensor):
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)

    def run():
        host.copy_(x, non_blocking=x.is_cuda)
        (host.to(x.device, non_blocking=True) if x.is_cuda else host.clone())

    return run, x.numel() * x.element_size()  # every byte leaves the device


def quantised(fmt: str):
    def make(x: torch.Tensor):
        def run():
            kernels.dequantize(kernels.quantize(x, 128, fmt))

        saved = x.numel() * x.element_size() - kernels.stored_nbytes(x.numel(), 128)
        return run, saved

    return make


STRATEGIES = {"offload": offload, "fp8": quantised("fp8_e4m3"), "int8": quantised("int8")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    rows, knees = [], []
    for name, make in STRATEGIES.items():
        bandwidths, first_time = [], None
        for size in SIZES:
            x = torch.randn(size // dtype.itemsize, dtype=dtype, device=device)
            run, saved = make(x)
            seconds = _timed(run, device, args.repeats)
            first_time = first_time if first_time is not None else seconds
            bandwidths.append(saved / seconds)
            rows.append([name, fmt_bytes(size), fmt_seconds(seconds), f"{saved / seconds / 1e9:.2f} GB/s"])
        peak = statistics.median(bandwidths[-3:])
        knees.append([name, fmt_seconds(first_time), f"{peak / 1e9:.2f} GB/s", fmt_bytes(peak * first_time)])
    print(f"device {device}, {args.dtype} activations, median of {args.repeats}\n")
    print(table(["strategy", "size", "added time", "mitigation bandwidth"], rows))
    print()
    print(table(["strategy", "launch t0", "peak B", "knee S = B * t0"], knees))
    return 0


if __name__ == "__main__":
    sys.exit(main())
