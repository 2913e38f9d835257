"""The conflicts of paper §V-A: consumers of one saved tensor that ask for different precision
(case 1) or placement (case 2). The runtime keeps one copy either way, so such a mitigation saves
nothing; the planner rejects it rather than undo an earlier, larger reduction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .graph import BlockGraph
from .model import CostModel
from .plan import Plan


@dataclass(frozen=True)
class Conflict:
    """One saved tensor whose savers ask for different precision (case 1) or placement (case 2)."""

    case: int
    layer: int
    tensor: str
    savers: dict[str, str]  # op name -> strategy

    def __str__(self) -> str:
        kind = "multi-precision" if self.case == 1 else "multi-device"
        asks = ", ".join(f"{op}: {s}" for op, s in self.savers.items())
        return f"case {self.case} ({kind}) in layer {self.layer}, tensor {self.tensor!r}: {asks}"


def conflicts(plan: Plan, cm: CostModel) -> list[Conflict]:
    """Every saved tensor whose savers the plan asks to keep in two precisions (case 1: FP8 at one
    saver, full precision at another) or two places (case 2: offloaded at one, on the device at
    another)."""
    return [c for layer, block in cm.blocks.items() for c in block_conflicts(block, dict(plan.block(layer)), layer)]


def block_conflicts(block: BlockGraph, plan: Mapping[str, str], layer: int = 0) -> list[Conflict]:
    """`conflicts` within one block under its ops' strategies (op name -> strategy; absent = keep)."""
    found = []
    for t in block.tensors:
        asks = {s: plan.get(s, "keep") for s in t.savers}
        forms = {_form(a, t.floating) for a in asks.values()} - {None}
        if len(forms) > 1:
            found.append(Conflict(1 if "fp8" in forms else 2, layer, t.name, asks))
    return found


def _form(strategy: str, floating: bool) -> str | None:
    """How one saver wants a tensor kept; None: recomputed (not kept by this saver)."""
    if strategy == "recompute":
        return None
    if strategy == "keep" or (strategy == "fp8" and not floating):
        return "full"
    return strategy
