"""Run a function on every rank of a local gloo group, each rank its own process: how the demo,
the benchmarks and the tests run expert parallelism on a CPU machine. A rank that fails, or a
collective that never completes, ends every rank and raises here: as on a cluster, one rank's
error (an out-of-memory included) stops the job, and a deadlock fails instead of hanging.

Ranks are forked from a `forkserver` that has imported the plugin (torch and transformers with
it) once per parent process: a rank then starts in well under a second where a spawned one
re-imports them (about 4 s of CPU each). The server forks from a clean, single-threaded state,
as spawn does; each rank takes the parent's environment as it is at the launch.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["bagualu_plugin"]  # imported once by the forkserver: every rank needs torch, transformers and the plugin
GRACE_S = 5.0  # after a first failure, how long the others' reports are awaited to name the cause


class RankError(RuntimeError):
    """A rank of `run_ranks` raised, exited, or ran past the deadline."""


def context():
    """The multiprocessing context of the ranks (and of anything passed to them, such as a queue)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def end_process(barrier: Callable[[], object] | None = None) -> NoReturn:
    """End a launched training process (torchrun, `accelerate launch`) once `barrier`, the last
    collective of every process, returns (None: the caller passed it) and all is written: without
    the teardown of the process group, which joins gloo's worker threads while holding the GIL. A
    worker still releasing a finished collective's tensors waits for the GIL, so the process hangs
    (seen now and then: the main thread in `~ProcessGroupGloo` joining, a worker in
    `~AsyncGatherWork`), or torch's C++ threads abort at the interpreter's exit. Nothing is left to
    do, so nothing is torn down."""
    if barrier is not None:
        barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, size: int, port: int, timeout_s: float, threads: int, env: dict, fn: Callable, args: tuple, results, faults: str
) -> None:
    # a crash (a signal) leaves every thread's Python stack in `faults`, which the parent reports
    faulthandler.enable(open(os.path.join(faults, f"rank{rank}.txt"), "w"), all_threads=True)  # noqa: SIM115 - the process's life
    os.environ.clear()
    os.environ.update(env)  # the parent's now, not the forkserver's from when it started
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
        results.put((rank, False, (time.time(), f"{type(error).__name__}: {error}\n{traceback.format_exc()}")))
        return
    dist.destroy_process_group()
    # by value (plain pickle): the queue would share tensors by file descriptor, gone with this process
    results.put((rank, True, pickle.dumps(result)))


def run_ranks(
    fn: Callable, size: int, *args, timeout_s: float = 120.0, threads: int | None = None, deadline_s: float | None = None
) -> list:
    """`fn(rank, size, *args)` on `size` processes joined in one gloo group (collectives time out
    after `timeout_s`); returns the ranks' results in rank order. `fn` must be importable (a
    module-level function) and its results picklable. A failure raises RankError naming its
    cause first (a rank killed, else the first to raise), then what the others reported.
    `threads`: torch threads per rank (default: the CPUs shared out, at least 1). `deadline_s`: how long the whole launch may take
    (default `timeout_s` + 60 s: starting and imports, then the collectives' own timeout); a
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
    ctx = context()
    results = ctx.Queue()
    port, env = free_port(), dict(os.environ)
    faults = tempfile.TemporaryDirectory(prefix="bagualu-ranks-")
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, port, timeout_s, threads, env, fn, args, results, faults.name), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + allowed
    out: dict[int, object] = {}
    failed: dict[int, tuple[float, str]] = {}  # rank -> (when, what), reported by the rank
    first = None  # when the first failure came
    try:
        while len(out) + len(failed) < size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                if _dead(procs, out, failed) or (first is not None and time.monotonic() > first + GRACE_S):
                    break
                if time.monotonic() > deadline:
                    raise RankError(f"ranks {sorted(set(range(size)) - set(out))} did not finish within {allowed:.0f} s") from None
                continue
            if ok:
                out[rank] = pickle.loads(value)
                continue
            first = first or time.monotonic()
            failed[rank] = value
        if failed or len(out) < size:
            raise RankError(_cause(procs, out, failed, faults.name)) from None
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        faults.cleanup()
    return [out[r] for r in range(size)]


def _dead(procs: list, out: dict, failed: dict) -> list[int]:
    """The ranks that exited without reporting (killed, or ended by their own `os._exit`)."""
    return [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out and r not in failed]


def _cause(procs: list, out: dict, failed: dict[int, tuple[float, str]], faults: str) -> str:
    """The job's failure, its cause first: a rank that died without a word (the others' errors
    follow from it), with the stacks its crash left in `faults`, else the first rank to raise;
    then the others' errors, a line each."""
    lines = []
    for r in _dead(procs, out, failed):
        code = procs[r].exitcode
        lines.append(f"rank {r} exited with code {code}{f' ({signal.Signals(-code).name})' if code < 0 else ''} before reporting")
        path = os.path.join(faults, f"rank{r}.txt")  # absent where the rank died before it ran
        if os.path.exists(path):
            with open(path) as stacks:
                lines.extend(line.rstrip() for line in stacks if line.strip())
    for r, (_, what) in sorted(failed.items(), key=lambda item: item[1][0]):
        lines.append(f"rank {r} failed: {what}" if not lines else f"then rank {r} failed: {what.splitlines()[0]}")
    return "\n".join(lines)
