"""What every demo rank learns from all the others, so that a rank that failed or ran out of memory
never leaves the rest blocked in a collective it will not join (the job stops as a whole, as on a
cluster)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def max_over_ranks(value: float) -> float:
    """The largest `value` of any rank: an iteration takes as long as its slowest rank."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def overrun_ranks(overran: bool) -> list[int]:
    """Every rank learns which ranks overran (one all-reduce): the collective OOM check."""
    flags = torch.zeros(dist.get_world_size())
    flags[dist.get_rank()] = float(overran)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [r for r, f in enumerate(flags.tolist()) if f]


def agree(error: str | None) -> str | None:
    """Every rank learns whether any rank failed (the first one's message), so that no rank goes
    on into a collective that the failed one never joins."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)
