"""Recompute in lockstep where an engine gathers parameters module by module: DeepSpeed ZeRO-3
or FSDP over several processes (`budget.fsdp`).

Such an engine gathers a module's weights from every rank when the module runs, and a recompute
region's replay in backward runs its modules again: gathers that every rank must join, in the
same order. Ranks whose micro-batches differ (their lengths, their padding, their routing) plan
differently, and a rank that replays a region the others keep waits in a gather while they reduce
gradients (seen under ZeRO-3 over gloo: a hang). So the ranks recompute the same ops in every
micro-batch: at a forward's start each rank also recomputes every op another rank recomputes
(`recomputed_anywhere`: recomputing keeps fewer bytes, so the plan still fits its budget), and at
each MoE gate the layer's experts are escalated on every rank when one rank escalates them
(`parallel.expert.any_rank`), the routing being each rank's own. Offloads and FP8 copies make no
collective: they stay each rank's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..config import Recipe
from ..costmodel.graph import OpId
from ..costmodel.plan import Plan


def lockstep_group(recipe: Recipe) -> dist.ProcessGroup | None:
    """The process group whose ranks recompute in lockstep: the world, under a full-sharding
    engine over several processes (the data-parallel group, which is the world without a
    pipeline); None where nothing is gathered by module or there is one process."""
    if not recipe.budget.fsdp or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if recipe.pipeline.pp != 1:
        raise ValueError(
            f"budget.fsdp with pipeline.pp={recipe.pipeline.pp}: under full sharding the ranks of a data-parallel group "
            "recompute in lockstep, and the plugin knows that group only without a pipeline (pipeline.pp must be 1)"
        )
    return dist.group.WORLD


def recomputed_anywhere(plan: Plan, ops: Sequence[OpId], group: dist.ProcessGroup, device: torch.device) -> Plan:
    """`plan` with every op of `ops` that some rank of `group` recomputes recomputed here too: one
    all-reduce of a flag per op on `device`, which every rank of the group makes with the same
    `ops`, at the same forward."""
    flags = torch.tensor([plan.get(op) == "recompute" for op in ops], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    theirs = {op: "recompute" for op, flag in zip(ops, flags.tolist()) if flag and plan.get(op) != "recompute"}
    return Plan({**plan, **theirs}) if theirs else plan
