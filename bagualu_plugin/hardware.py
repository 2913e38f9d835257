"""What one accelerator offers: compute, memory, and the links that offload and dispatch use.

The cost model (paper §IV) turns these numbers into operator times and into the knee points
(S_i, B_i) of each mitigation strategy's roofline: kernel launch overhead and HBM bandwidth bound
recompute and FP8 casts, copy launch overhead and host-link bandwidth bound offload. The links'
small-message latencies price the one collective whose bytes are negligible: the gates' agreement
on a collective escalation under expert parallelism (§V-A, `all_reduce_s`).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from .units import Bandwidth, Bytes, Flops, Seconds


class HardwareSpec(BaseModel):
    """One device. Bandwidths are per direction and per device; sizes in bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(min_length=1)
    peak_flops: Flops = Field(gt=0, description="dense BF16 FLOP/s")
    capacity_bytes: Bytes = Field(gt=0, description="device memory (HBM)")
    hbm_bandwidth: Bandwidth = Field(gt=0)
    host_link_bandwidth: Bandwidth = Field(gt=0, description="device<->host, drives offload cost")
    intra_node_bandwidth: Bandwidth = Field(gt=0)
    inter_node_bandwidth: Bandwidth = Field(gt=0)
    devices_per_node: int = Field(ge=1)
    kernel_launch_s: Seconds = Field(gt=0, description="fixed cost of one kernel")
    copy_launch_s: Seconds = Field(gt=0, description="fixed cost of one host<->device copy")
    cast_bandwidth: Bandwidth | None = Field(
        default=None, gt=0, description="bytes read + written per second by the FP8 cast kernels; None: hbm_bandwidth"
    )
    cast_launch_s: Seconds | None = Field(default=None, gt=0, description="fixed cost of one cast; None: kernel_launch_s")
    # Small-message latencies: the paper gives none. The defaults are NCCL's own tuning model
    # (`ncclTopoTuneModel`, src/graph/tuning.cc): one hop of its tree all-reduce with the LL
    # protocol costs 0.6 us over NVLink and 5 us over the network.
    intra_node_latency_s: Seconds = Field(default=0.6e-6, gt=0, description="one hop of a small message between devices of a node")
    inter_node_latency_s: Seconds = Field(default=5e-6, gt=0, description="one hop of a small message between nodes")
    simulated: bool = Field(default=False, description="capacity is enforced by the Ledger, not by a device")

    def all_reduce_s(self, group: int) -> float:
        """Seconds of one all-reduce of a few bytes over `group` devices, consecutive on nodes of
        `devices_per_node` (the expert-parallel group, as `costmodel.analytic` places it for the
        all-to-alls): NCCL's latency model of its tree all-reduce, a chain through each node's
        devices and a tree over the nodes, up and back down, after one kernel launch (standing for
        NCCL's base latency, 6.8 us). The bytes cost nothing next to that."""
        if group <= 1:
            return 0.0
        per_node, nodes = min(group, self.devices_per_node), -(-group // self.devices_per_node)
        hops = (per_node - 1) * self.intra_node_latency_s + math.ceil(math.log2(nodes)) * self.inter_node_latency_s
        return self.kernel_launch_s + 2 * hops


_GIB, _MIB = 2**30, 2**20

PRESETS: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        # §VI-A: 480 TFLOP/s BF16, 64 GB HBM, 8 per node, 400 GB/s intra-node, 4x400 Gb/s per node.
        # Host link: Fig. 6 offloads 96 MB in 2.0 ms each way (48 GB/s). HBM bandwidth is not
        # given in the paper; 1.8 TB/s is an assumption of the HBM2e class at 64 GB, and so are
        # the small-message latencies (the defaults, NCCL's).
        HardwareSpec(
            name="bagualu2",
            peak_flops=480e12,
            capacity_bytes=64 * _GIB,
            hbm_bandwidth=1.8e12,
            host_link_bandwidth=48e9,
            intra_node_bandwidth=400e9,
            inter_node_bandwidth=4 * 400e9 / 8 / 8,
            devices_per_node=8,
            kernel_launch_s=5e-6,
            copy_launch_s=10e-6,
        ),
        # Datasheet figures; capacities as the CUDA driver reports them; PCIe per direction;
        # NVLink per direction; one NIC per GPU.
        HardwareSpec(
            name="h100",
            peak_flops=989.4e12,
            capacity_bytes=81559 * _MIB,
            hbm_bandwidth=3.35e12,
            host_link_bandwidth=64e9,
            intra_node_bandwidth=450e9,
            inter_node_bandwidth=400e9 / 8,
            devices_per_node=8,
            kernel_launch_s=5e-6,
            copy_launch_s=10e-6,
        ),
        HardwareSpec(
            name="h200",
            peak_flops=989.4e12,
            capacity_bytes=143771 * _MIB,
            hbm_bandwidth=4.8e12,
            host_link_bandwidth=64e9,
            intra_node_bandwidth=450e9,
            inter_node_bandwidth=400e9 / 8,
            devices_per_node=8,
            kernel_launch_s=5e-6,
            copy_launch_s=10e-6,
        ),
        HardwareSpec(
            name="a100",
            peak_flops=312e12,
            capacity_bytes=81920 * _MIB,
            hbm_bandwidth=2.039e12,
            host_link_bandwidth=32e9,
            intra_node_bandwidth=300e9,
            inter_node_bandwidth=200e9 / 8,
            devices_per_node=8,
            kernel_launch_s=5e-6,
            copy_launch_s=10e-6,
        ),
        # This machine class: no accelerator, so capacity is simulated by the Ledger
        # (docs/architecture.md). The mitigation knees are measured on a 2-core VM by
        # `python benchmarks/mitigation_roofline.py` (bf16, medians): offload moves 8 GB/s of
        # activations out and back (16 GB/s per direction) after a 2.8 us start; FP8 cast and
        # cast-back save 0.09 GB/s after 52 us (torch reference kernels: 0.55 GB/s read +
        # written, 13 us per cast). Compute and memory rates are conservative 2-core figures.
        HardwareSpec(
            name="cpu",
            peak_flops=50e9,
            capacity_bytes=2 * _GIB,
            hbm_bandwidth=10e9,
            host_link_bandwidth=16e9,
            intra_node_bandwidth=5e9,
            inter_node_bandwidth=1e9,
            devices_per_node=1,
            kernel_launch_s=10e-6,
            copy_launch_s=1.4e-6,
            cast_bandwidth=0.55e9,
            cast_launch_s=13e-6,
            simulated=True,
        ),
    )
}


def preset(name: str) -> HardwareSpec:
    """The preset called `name`; the error lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
