"""The demo's processes: `run_demo` starts `parallel.ep` gloo ranks (`parallel.launch.run_ranks`),
each running `demo_rank`: profile, pretrain, then every policy, iteration by iteration in turn, so
a slow spell of a shared machine costs them all alike and the throughput ratios of one run can be
trusted. Every rank runs the same steps in the same order, or none goes on (`collectives.agree`)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..collector import ManualCollector
from ..config import Recipe
from ..costmodel import CostModel
from ..parallel.launch import context, run_ranks
from ..spikes import imbalance_schedule
from .collectives import agree
from .model import check_capacity, demo_cost, demo_stage, pretrained, rank_batches, rank_recipe
from .policies import POLICIES, PolicyResult, PolicyRun

THREADS_PER_RANK = 1  # the ranks share the machine's cores: one torch thread each


def _caching_host_allocator() -> None:
    """Keep freed host memory for reuse, as a GPU's caching allocator does, for the rest of the
    process. By default glibc maps every block over 128 KiB afresh and unmaps it when freed, so a
    policy that keeps more activations alive pays page faults per allocation that no GPU run pays
    (15% of an iteration of the demo without mitigation). No-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


@dataclass(frozen=True)
class SetupError:
    """A rank's setup failed (e.g. a capacity that cannot hold M0); every rank returns it."""

    message: str


def demo_rank(
    rank: int, size: int, recipe: Recipe, steps: int, policies: Sequence[str], seed: int = 0, progress=None,
    manual_gc: bool = True,
) -> list[PolicyResult] | SetupError:
    """The demo on expert-parallel rank `rank` of `size` (a `run_ranks` worker): profile, pretrain,
    then `steps` iterations of every policy, taking turns, all in the same order as every other
    rank. `progress`: a queue the hot rank puts 1 on after every policy iteration; `manual_gc`:
    `collector.ManualCollector` around the policies' iterations (else Python's own collector)."""
    _caching_host_allocator()
    hot = recipe.parallel.ep_rank
    mine = rank_recipe(recipe, rank)
    cost = demo_cost(mine, seed)
    stage = demo_stage(mine, cost)
    try:
        check_capacity(stage)  # before any training
    except ValueError as exc:
        error = str(exc)
    else:
        error = None
    if (error := agree(error)) is not None:
        return SetupError(error)
    schedule = imbalance_schedule(recipe.spikes, steps, recipe.pipeline.micro_batches, cost.moe_layers)
    batches = rank_batches(recipe, rank, seed)
    start = pretrained(stage, batches, seed)
    runs, error = [], None
    try:
        runs = [PolicyRun(p, stage, schedule, batches, start, hot) for p in policies]
    except ValueError as exc:
        error = str(exc)
    if (error := agree(error)) is not None:
        for run in runs:
            run.close()
        return SetupError(error)
    # What exists now (models, cost model, torch and HF modules) lives to the end (`collector`):
    # else each full collection walks it all (0.2 s here, at random iterations of random policies);
    # every rank collects after each policy iteration, outside its timed span
    try:
        with ManualCollector(manual_gc) as collector:
            for it in range(steps):
                for run in runs:
                    run.iteration(it)
                    collector.step()
                    if progress is not None and rank == hot:
                        progress.put(1)
    finally:
        results = [run.close() for run in runs]
    return results


def run_demo(
    recipe: Recipe,
    steps: int,
    policies: Sequence[str] = POLICIES,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    timeout_s: float | None = None,
    manual_gc: bool = True,
) -> list[PolicyResult]:
    """`steps` iterations of every policy on `recipe.parallel.ep` expert-parallel ranks, each its
    own process (`demo_rank`); returns, per policy, the hot rank's (`parallel.ep_rank`) memory
    with the job's OOMs, time and tokens, and every rank's peak. `progress(n)` is called (from a
    thread of this process) after every policy iteration. `timeout_s`: the job's deadline and
    the collectives' timeout (default: generous for the demo's size); `manual_gc`: every rank's
    garbage collector frozen after set-up, collecting between policy iterations (`demo_rank`)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"policies must be a non-empty subset of {POLICIES}, got {list(policies)}")
    ep = recipe.parallel.ep
    if ep < 2 or recipe.model.num_experts % ep:
        raise ValueError(f"the demo needs parallel.ep >= 2 dividing model.num_experts={recipe.model.num_experts}, got {ep}")
    # before starting any process: a capacity that cannot hold M0 by the analytic cost model
    # (each rank checks again with its profiled one)
    check_capacity(demo_stage(recipe, CostModel.from_config(recipe.model, recipe.hardware, recipe.parallel)))
    timeout_s = timeout_s or 120 + 10 * steps * len(policies)
    queue, pump = None, None
    if progress is not None:
        queue = context().SimpleQueue()
        pump = threading.Thread(target=_pump, args=(queue, progress), daemon=True)
        pump.start()
    try:
        ranks = run_ranks(
            demo_rank, ep, recipe, steps, list(policies), seed, queue, manual_gc, timeout_s=timeout_s, threads=THREADS_PER_RANK
        )
    finally:
        if queue is not None:
            queue.put(None)
            pump.join(timeout=10)
    failed = next((r for r in ranks if isinstance(r, SetupError)), None)
    if failed is not None:
        raise ValueError(failed.message)
    hot = ranks[recipe.parallel.ep_rank]
    for i, result in enumerate(hot):
        result.rank_peak_device_bytes = [r[i].peak_device_bytes for r in ranks]
    return hot


def _pump(queue, progress: Callable[[int], None]) -> None:
    while (n := queue.get()) is not None:
        progress(n)
