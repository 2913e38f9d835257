"""nanotron's `ParallelContext` on any device, and its layout read the same way on PyPI 0.4 and on
nanotron main.

The stock `ParallelContext.__init__` makes every group (world = ep x pp x dp x tp; main adds a
context-parallel axis between dp and tp) with no CUDA call but one: `set_device` selects the GPU of
`LOCAL_RANK`. `CPUParallelContext` overrides only that, to do nothing without CUDA; its
`backend="nccl"` assertion checks an argument, not the initialised group, so gloo groups pass.
Its groups take nanotron's own timeout (10 minutes); the launcher's own groups take its `--timeout-s`.

nanotron main (checked at 2411b022) cannot make expert-parallel groups: it asserts
tp x cp x dp x pp = world, then lays the world out as ep x pp x dp x cp x tp, so any
expert_parallel_size > 1 fails its assertion; `EXPERT_PARALLEL` says whether this nanotron can.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.distributed as dist

from .compat import import_pipeline

import_pipeline()

from nanotron.parallel.context import ParallelContext  # noqa: E402

EXPERT_PARALLEL = "context_parallel_size" not in inspect.signature(ParallelContext.__init__).parameters


class CPUParallelContext(ParallelContext):
    """nanotron's `ParallelContext`; `set_device` selects a GPU only where there is one."""

    def set_device(self):
        if torch.cuda.is_available():
            super().set_device()


def parallel_context(tp: int, pp: int, dp: int, ep: int) -> CPUParallelContext:
    """The groups of nanotron's layout (keywords: main inserts `context_parallel_size` before `ep`)."""
    return CPUParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, expert_parallel_size=ep)


def rank_matrix(pc: ParallelContext) -> np.ndarray:
    """World ranks as [ep, pp, dp, tp] (main's context-parallel axis, of size 1 here, dropped)."""
    return pc.world_rank_matrix.reshape(pc.expert_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size, pc.tensor_parallel_size)


def expert_group(pc: ParallelContext) -> dist.ProcessGroup:
    """The expert-parallel group: `expert_pg` on PyPI 0.4, `ep_pg` on main."""
    return pc.expert_pg if hasattr(pc, "expert_pg") else pc.ep_pg
