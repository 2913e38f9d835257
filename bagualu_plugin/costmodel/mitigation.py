"""What a per-operator mitigation plan does to one block's memory and time (paper §IV-B, §V-A).

Strategies act on the tensors an operator saves for backward:

- keep: the saver holds the tensor on the device;
- recompute: the recomputed operators are covered by the block's recompute units (the whole layer,
  its MoE block, attention as a whole, single ops), largest first; each unit is one checkpoint
  region: tensors produced inside it are dropped, its inputs are held, and in backward its
  forward runs again (Δt_b grows by its Δt_f);
- offload: the saver's copy lives on the host; one copy out in forward, one back in backward;
  tensors below `offload_min_bytes` stay on the device;
- fp8: the saver holds an e4m3 copy with one FP32 scale per block, cast in forward and back in
  backward; integer tensors stay as they are.

Memory is counted per storage: a tensor costs device bytes if any holder keeps it at full precision
on the device, plus one FP8 copy if any holder stores FP8, and host bytes if any holder offloads.
So inconsistent holders of one tensor (the conflicts of §V-A) cost what they really cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..hardware import HardwareSpec
from .graph import BlockGraph
from .linear import Load
from .roofline import cast_kernel, fp8_stored_bytes, offload_copy

Strategy = Literal["keep", "recompute", "offload", "fp8"]
STRATEGIES: tuple[str, ...] = Strategy.__args__
MITIGATIONS: tuple[str, ...] = STRATEGIES[1:]


@dataclass(frozen=True)
class MitigationOptions:
    fp8_block_size: int = 128
    offload_min_bytes: int = 0


@dataclass(frozen=True)
class Footprint:
    """Saved activations of one forward micro-batch and the time its mitigation adds."""

    device_bytes: float = 0.0
    host_bytes: float = 0.0
    forward_extra_s: float = 0.0
    backward_extra_s: float = 0.0

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(
            self.device_bytes + other.device_bytes,
            self.host_bytes + other.host_bytes,
            self.forward_extra_s + other.forward_extra_s,
            self.backward_extra_s + other.backward_extra_s,
        )


def recompute_regions(block: BlockGraph, plan: Mapping[str, str]) -> list[tuple[str, ...]]:
    """The checkpoint regions that realise the plan's recomputed ops: recompute units, largest
    first. An op that no unit covers on its own is an error that names the units to use."""
    wanted = {op for op, strategy in plan.items() if strategy == "recompute"}
    regions: list[tuple[str, ...]] = []
    for unit in block.recompute_units:
        if set(unit) <= wanted:
            regions.append(unit)
            wanted -= set(unit)
    if wanted:
        units = ", ".join("+".join(u) for u in block.recompute_units if set(u) & wanted)
        raise ValueError(f"{block.kind} block: {sorted(wanted)} cannot be recomputed alone; recompute units: {units}")
    return regions


def footprint(
    block: BlockGraph,
    plan: Mapping[str, str],
    load: Load,
    hw: HardwareSpec,
    options: MitigationOptions = MitigationOptions(),
) -> Footprint:
    """Device and host bytes of `block` under `plan` (op name -> strategy; absent = keep)."""
    unknown = set(plan) - set(block.op_names)
    if unknown:
        raise KeyError(f"plan names ops {sorted(unknown)} that a {block.kind} block lacks")
    bad = {s for s in plan.values() if s not in STRATEGIES}
    if bad:
        raise ValueError(f"unknown strategies {sorted(bad)}; expected one of {STRATEGIES}")

    region_of: dict[str, frozenset[str]] = {}
    held: set[str] = set()  # tensors a checkpoint region keeps as its input
    produced_by = {t.name: t.producer for t in block.tensors}
    for region in recompute_regions(block, plan):
        members = frozenset(region)
        for name in region:
            region_of[name] = members
        inputs = {t for op in block.ops if op.name in members for t in op.inputs}
        held |= {t for t in inputs if produced_by[t] not in members}

    copy, cast = offload_copy(hw), cast_kernel(hw)
    device = host = fwd = bwd = 0.0
    for t in block.tensors:
        size = t.bytes(load)
        on_device = t.name in held
        fp8 = offload = False
        for saver in t.savers:
            strategy = plan.get(saver, "keep")
            if strategy == "recompute":
                on_device |= t.producer not in region_of[saver]
            elif strategy == "offload" and size >= options.offload_min_bytes:
                offload = True
            elif strategy == "fp8" and t.floating:
                fp8 = True
            else:
                on_device = True
        device += size if on_device else 0.0
        if fp8:
            stored = fp8_stored_bytes(t.elements.at(load), options.fp8_block_size)
            device += stored
            fwd += cast.time(size + stored)
            bwd += cast.time(size + stored)
        if offload:
            host += size
            fwd += copy.time(size)
            bwd += copy.time(size)
    bwd += sum(op.forward_s.at(load) for op in block.ops if op.name in region_of)
    return Footprint(device, host, fwd, bwd)
