"""Run a function on every rank of a local gloo group, each rank its own process: how the demo,
the benchmarks and the tests run expert parallelism on a CPU machine. A rank that fails, or a
collective that never completes, ends every rank and raises here: as on a cluster, one rank's
error (an out-of-memory included) stops the job, and a deadlock fails instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank of `run_ranks` raised, exited, or ran past the deadline."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, timeout_s: float, threads: int, fn: Callable, args: tuple, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
        )
        result = fn(rank, size, *args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises
        # reported before this process's sockets close, so the parent hears the cause before the
        # other ranks' "connection closed"
        results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        return
    dist.destroy_process_group()
    # by value (plain pickle): the queue would share tensors by file descriptor, gone with this process
    results.put((rank, True, pickle.dumps(result)))


def run_ranks(
    fn: Callable, size: int, *args, timeout_s: float = 120.0, threads: int | None = None, deadline_s: float | None = None
) -> list:
    """`fn(rank, size, *args)` on `size` spawned processes joined in one gloo group (collectives
    time out after `timeout_s`); returns the ranks' results in rank order. `fn` must be importable
    (a module-level function) and its results picklable. `threads`: torch threads per rank
    (default: the CPUs shared out, at least 1). `deadline_s`: how long the whole launch may take
    (default `timeout_s` + 60 s: spawning and imports, then the collectives' own timeout); a
    longer one for a launch that runs several jobs, each collective still timing out after
    `timeout_s`."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if deadline_s is not None and deadline_s <= 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
    allowed = timeout_s + 60 if deadline_s is None else deadline_s
    threads = threads or max(1, (os.cpu_count() or 1) // size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, port, timeout_s, threads, fn, args, results), daemon=True) for r in range(size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + allowed
    out: dict[int, object] = {}
    try:
        while len(out) < size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RankError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    raise RankError(f"ranks {sorted(set(range(size)) - set(out))} did not finish within {allowed:.0f} s") from None
                continue
            if not ok:
                raise RankError(f"rank {rank} failed: {value}")
            out[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(size)]
