"""The payoff on one GPU, measured once (paper §II-B, §IV, §V-A, §V-B, §VI-C): a mid-size MoE
(a GLM-4-MoE of hidden 2048, 32 experts top-8, bf16, random init, 4 layers) on a device whose
capacity cannot hold a 2.6x routing spike unmitigated. One command, one table per part:

1. payoff: the demo's policies (`demo.policies`: adaptive, none, full recompute, static average
   and worst case, unbounded, oracle) train the same iterations, taking turns iteration by
   iteration, at a capacity lowered with `torch.cuda.set_per_process_memory_fraction` between
   what the normal band and a 2.6x spike need unmitigated (measured, not guessed); a real
   `torch.OutOfMemoryError` is a restart, charged as `bagualu demo` charges it (§VI-C); tokens/s
   count the group's tokens, the mirrors' too, as `bagualu demo` counts every rank's. Beside them
   what users reach for instead (`alternatives.py`): transformers' gradient checkpointing, torch's
   selective checkpointing with torchtitan's op policy and TRL's activation offloading (GPU only),
   at the same capacity on the same batches;
2. tax: what `bgl.apply` costs at an ample capacity, where every plan is empty
   (`benchmarks/overhead.py`'s alternation, `_alternate`);
3. dual batch: `bgl.apply` with fused steady points (§V-B, `runtime.dual_batch`) against the
   unfused 1F1B order, offloading in every micro-batch (a capacity of `TIGHT` times what the
   normal band keeps): wall time, and the share of the offload copies' time (on the host pool's
   side streams) that compute kernels on other streams hide, from the torch profiler's trace;
4. time error: the cost model's forward and backward time of every operator (summed over the
   layers) against CUDA-event timings of the same model, for the analytic model the plans come
   from and for `bgl.profile`'s fit (§IV-A).

    python benchmarks/gpu_payoff.py [--iterations 40] [--json FILE]   (one H200: at most 8 minutes)
    python benchmarks/gpu_payoff.py --cpu [--json FILE]               (the same steps, small, on CPU: CI)

One device is one expert-parallel rank, the others emulated. A routing spike raises a device's
activation memory only under expert parallelism: only the pairs routed to its own experts grow
(§II-B), and one device has no peers to receive them from. So this process is rank 0, the hot
rank, of a group of `EP` ranks whose `EP - 1` others are mirrors of it (`Mirrors`, a
torch.distributed process group inside this process): each is taken to route its own tokens as
this rank does, so what a mirror sends this rank is what this rank sends itself, and a skew of
fraction f onto rank 0's experts (`adapters.gate.RoutingSkew`) brings it 1 + f (EP - 1) times its
balanced pairs, as real peers routing alike would. Measured as on a real hot rank: its model (1/EP
of the routed experts), its activation memory, its compute on every row it receives, its plans,
gates and restarts. Not measured: the all-to-alls' network time (a copy on this device here), the
peers' memory and waits, and the values of what comes back for the rows this rank sends away (a
mirror returns a stand-in of the right shape), so losses are not a real job's.

The skew rewrites each MoE layer's routing after its router: a new index (tokens x k int64) that
dispatch keeps and a real router does not make. The analytic model prices a real router, so the
first micro-batch of the planned policies misses those bytes (a cost-model warning, one "missed
forward"), and the Calibration plans on them from the next one.

Each part has a time budget (`Mode.budget_s`) and stops iterating when it is spent; the garbage
collector is frozen after set-up and collects between iterations (`collector.ManualCollector`).
With `--cpu` (taken by CI) the same code runs a small model on the CPU: the capacity is the
Ledger's simulated one (an overrun is `runtime.ledger.SimulatedOutOfMemoryError`, a
torch.OutOfMemoryError), clocks are perf_counter's, and what needs CUDA streams is reported as not
measurable on CPU.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.profiler
from alternatives import ALTERNATIVES, GPU_ONLY, AlternativeRun  # benchmarks/ is the script's folder, on sys.path
from gpu_check import _intervals
from overhead import _alternate, _ample
from torch._C._distributed_c10d import (
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    _create_work_from_future,
)
from torch.futures import Future

from bagualu_plugin import Recipe, apply
from bagualu_plugin.adapters import Adapter
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.collector import ManualCollector, frozen
from bagualu_plugin.costmodel import Forward
from bagualu_plugin.demo import POLICIES
from bagualu_plugin.demo.model import pretrained, rank_batches, rank_model
from bagualu_plugin.demo.policies import PLANNED, PolicyRun
from bagualu_plugin.report import plot_timeline, summary, table
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.runtime.profiler import _instrumented, _Provenance, profile
from bagualu_plugin.spikes import imbalance_schedule
from bagualu_plugin.stage import Stage
from bagualu_plugin.units import fmt_bytes

EP = 4  # the emulated expert-parallel group: this process is its rank 0
SPIKE_PROBABILITY = 0.25  # of an iteration (the paper's 2.9% needs hundreds: benchmarks/spike_cpu.py)
FORCED_SPIKE = (1, 1)  # (iteration, micro-batch) routed at spike_max_imbalance on every MoE layer
CAPACITY_POINT = 0.5  # the activation capacity, from the normal band's peak towards the spike's
RESERVE_MARGIN = 1.5  # the allocator's bytes beyond the Ledger's (gradients, temporaries), with room
TIGHT = 0.6  # part 3's activation capacity, of the normal band's peak: every micro-batch mitigates
MIN_ITERATIONS = 2  # per part, whatever its budget: the forced spike is in iteration 1


@dataclass(frozen=True)
class Mode:
    """The sizes of one run: the model's dimensions (a recipe's `model:`), the micro-batch, the
    iterations and each part's time budget."""

    name: str
    preset: str
    model: dict
    batch: dict
    micro_batches: int
    iterations: int
    repeats: int  # part 4's timed forwards and backwards
    budget_s: dict = field(default_factory=dict)


GPU = Mode(
    "cuda", "h200",
    dict(family="glm4_moe", hidden_size=2048, num_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
         vocab_size=16384, num_experts=32, top_k=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
         first_k_dense=1, dense_intermediate_size=5632, dtype="bf16", attention="sdpa"),
    dict(seq_len=4096, micro_batch_size=2), micro_batches=8, iterations=40, repeats=5,
    budget_s={"payoff": 180, "tax": 45, "dual batch": 60},
)
CPU = replace(  # the same model but its widths, the same pipeline and expert parallelism, smaller batches
    GPU, name="cpu", preset="cpu",
    model={**GPU.model, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "dense_intermediate_size": 128, "dtype": "fp32"},
    batch=dict(seq_len=64, micro_batch_size=1), micro_batches=5, iterations=3, repeats=2,
    budget_s={"payoff": 20, "tax": 10, "dual batch": 10},
)


# ---------------------------------------------------------------- the emulated expert-parallel group


def _done(value) -> object:
    future = Future()
    future.set_result(value)
    return _create_work_from_future(future)


class Mirrors(dist.ProcessGroup):
    """An expert-parallel world of `size` ranks in this one process, all but this rank mirrors of
    it (see the module's docstring). Every collective completes at once:

    - all-to-all: from each rank comes what this rank sends itself, cut to or padded with zeros to
      the size this rank expects from it. Counts and dispatched rows (every mirror routes as this
      rank does) are what real peers routing alike would send; what returns for rows sent away
      (combine, and dispatch's backward) is a stand-in;
    - all-reduce: each rank holds what this one holds (SUM multiplies by the ranks; MAX, MIN, AVG
      keep it); barrier and broadcast: nothing to wait for, nothing differs."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return "mirrors"

    def allreduce(self, tensors, opts=AllreduceOptions()):
        if opts.reduceOp == ReduceOp.SUM:
            for t in tensors:
                t.mul_(self._size)
        elif not any(opts.reduceOp == op for op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG)):
            raise NotImplementedError(f"Mirrors: all-reduce {opts.reduceOp}")
        return _done(tensors)

    def barrier(self, opts=BarrierOptions()):
        return _done([])

    def broadcast(self, tensors, opts=BroadcastOptions()):
        return _done(tensors)

    def alltoall_base(self, out, inp, out_splits, in_splits, opts=AllToAllOptions()):
        mine = inp.split(in_splits or inp.size(0) // self._size)[self._rank]
        for chunk in out.split(out_splits or out.size(0) // self._size):
            n = min(len(chunk), len(mine))
            chunk[:n].copy_(mine[:n])
            chunk[n:].zero_()
        return _done([out])


if not hasattr(dist.Backend, "MIRRORS"):
    dist.Backend.register_backend("mirrors", lambda store, rank, size, timeout: Mirrors(rank, size), devices=["cpu", "cuda"])


@contextmanager
def mirrored(size: int = EP):
    """This process as rank 0 of `size` ranks, the others `Mirrors`: the default process group."""
    dist.init_process_group("mirrors", store=dist.HashStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the device


class Device:
    """The device under test, alike on CUDA and CPU: when its queued work has run, what it holds
    and may hold, and its clock (CUDA events, else perf_counter)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.total = torch.cuda.get_device_properties(device).total_memory if self.cuda else 0
        self.name = torch.cuda.get_device_name(device) if self.cuda else "CPU"

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def settled(self, seconds: float) -> float:
        """`seconds` up to the host's last call, plus the wait until the device has run what it
        queued by then (`overhead._alternate`'s `slowest`: an iteration ends when its device is done)."""
        start = time.perf_counter()
        self.settle()
        return seconds + time.perf_counter() - start

    def cap(self, nbytes: int | None) -> None:
        """What the allocator may hold at most (None: the whole device); no-op on CPU, where the
        Ledger's simulated capacity is the recipe's."""
        if self.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0 if nbytes is None else min(1.0, nbytes / self.total), self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


# ---------------------------------------------------------------- set-up


def make_recipe(mode: Mode, activations: int, reserve: int = 0, *, dual_batch: bool = False, offload_only: bool = False) -> Recipe:
    """Pipeline rank 0 of 4 (its micro-batches in flight at once, 1F1B), rank 0 of the `EP` group,
    `activations` bytes of activation capacity: the recipe's static bytes are 0, each policy's
    weights and optimizer state stand beside that capacity (on a GPU, `reserve` more for what the
    allocator holds beyond the saved tensors). Plans recompute and offload (at any size), or
    offload only, so that every plan's tensors go through the host pool's copy streams (the gates
    still escalate by recomputing the experts)."""
    return Recipe.from_dict({
        "hardware": {"preset": mode.preset, "capacity_bytes": activations + reserve},
        "model": mode.model,
        "parallel": {"ep": EP, "ep_rank": 0, "dp": EP},
        "pipeline": {"pp": 4, "rank": 0, "micro_batches": mode.micro_batches, "dual_batch": dual_batch},
        "batch": mode.batch,
        "budget": {"non_activation_bytes": 0, "reserve_bytes": reserve},
        "strategies": {"allowed": ["offload"] if offload_only else ["recompute", "offload"], "offload": {"min_bytes": 0}},
        "spikes": {"enabled": True, "seed": 0, "spike_probability": SPIKE_PROBABILITY},
    })


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def interleave(dev: Device, runs: list, iterations: int, budget_s: float, cap: int | None = None) -> tuple[int, list[int]]:
    """Up to `iterations` of every run, taking turns iteration by iteration (a slow spell of the
    machine costs them all alike), the unbounded run without the allocator's cap; after
    `MIN_ITERATIONS`, stops once `budget_s` is spent. Returns the iterations and each run's
    allocator peak (0 on CPU)."""
    peaks, start, ran = [0] * len(runs), time.perf_counter(), 0
    try:
        with ManualCollector() as collector:
            while ran < iterations and (ran < MIN_ITERATIONS or time.perf_counter() - start < budget_s):
                for i, run in enumerate(runs):
                    dev.cap(None if run.current == "unbounded" else cap)
                    dev.reset_peak()
                    run.iteration(ran)
                    peaks[i] = max(peaks[i], dev.peak())
                    collector.step()
                ran += 1
    finally:
        dev.cap(None)
    return ran, peaks


def _spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})" if times else "-"


# ---------------------------------------------------------------- 1. payoff


def calibrate(dev: Device, stage: Stage, batches: list, start: dict) -> dict:
    """What the unbounded run keeps at the peak of an iteration routed at the normal band's top on
    every micro-batch, and of one whose micro-batch `FORCED_SPIKE[1]` spikes to the largest
    imbalance: the Ledger's activation bytes, and on a GPU what the allocator held beyond them and
    the bytes before the iteration (gradients, temporaries: `transient`)."""
    spikes, layers, m = stage.recipe.spikes, stage.cost.moe_layers, stage.recipe.pipeline.micro_batches
    normal = [dict.fromkeys(layers, spikes.normal_max_imbalance) for _ in range(m)]
    spiked = [dict(x) for x in normal]
    spiked[FORCED_SPIKE[1]] = dict.fromkeys(layers, spikes.spike_max_imbalance)
    run = PolicyRun("unbounded", stage, [normal, spiked], batches, start, hot=0)
    out = {}
    try:
        for it, name in enumerate(("normal", "spike")):
            before = dev.allocated()
            dev.reset_peak()
            run.iteration(it)
            kept = max(e.peak for e in run.result.timeline if e.iteration == it) - stage.static_bytes
            out[name] = kept
            out[f"{name}_transient"] = max(0, dev.peak() - before - kept) if dev.cuda else 0
    finally:
        run.close()
    return out


def payoff(dev: Device, mode: Mode, iterations: int, cost, batches: list, start: dict, png: str | None = None) -> dict:
    probe = Stage.of(make_recipe(mode, 1 << 50), cost, split=False)
    cal = calibrate(dev, probe, batches, start)
    activations = int(cal["normal"] + CAPACITY_POINT * (cal["spike"] - cal["normal"]))
    reserve = math.ceil(RESERVE_MARGIN * max(cal["normal_transient"], cal["spike_transient"]))
    stage = Stage.of(make_recipe(mode, activations, reserve), cost, split=False)
    spikes = stage.recipe.spikes
    schedule = imbalance_schedule(spikes, iterations, mode.micro_batches, cost.moe_layers)
    it, mb = FORCED_SPIKE
    schedule[it][mb] = dict.fromkeys(cost.moe_layers, spikes.spike_max_imbalance)
    runs = [PolicyRun(policy, stage, schedule, batches, start, hot=0) for policy in POLICIES]
    skipped = {a: f"not run: {GPU_ONLY[a]}" for a in ALTERNATIVES if a in GPU_ONLY and not dev.cuda}
    for alternative in ALTERNATIVES:
        if alternative not in skipped:
            try:
                runs.append(AlternativeRun(alternative, stage, schedule, batches, start, hot=0))
            except Exception as exc:  # noqa: BLE001 - another library failing to install fails its row alone
                skipped[alternative] = f"failed to install: {type(exc).__name__}: {exc}"[:200]
    # on a GPU every run's weights and optimizer state stay on the device beside the capacity each
    # run gets (AdamW's two moments come with a run's first step), and the allocator holds `reserve`
    # beyond the saved tensors: the cap is all of it
    gc.collect()  # the calibration's run is gone
    resident = dev.allocated() + sum(2 * _param_bytes(run.model) for run in runs) if dev.cuda else None
    cap = resident + reserve + activations if dev.cuda else None
    began = time.perf_counter()
    try:
        ran, peaks = interleave(dev, runs, iterations, mode.budget_s["payoff"], cap)
    finally:
        results = [run.close() for run in runs]
    failed = [run for run in runs if getattr(run, "error", None)]
    skipped.update({run.alternative: f"failed: {run.error}" for run in failed})
    ran_through = [(result, peak) for run, result, peak in zip(runs, results, peaks) if run not in failed]
    results = [result for result, _ in ran_through]
    rows = summary(results)
    if png:
        plot_timeline(results, png, activations + stage.static_bytes, spikes.normal_max_imbalance, 2 * mode.micro_batches,
                      f"gpu_payoff.py on {dev.name}: rank 0 of {EP} expert-parallel ranks (mirrors), activation capacity "
                      f"{fmt_bytes(activations)}")
    for row, (result, peak) in zip(rows, ran_through):
        row.update(iteration_s=result.iteration_s, allocator_peak_bytes=peak,
                   oom_iterations=sorted({e.iteration for e in result.timeline if e.oom}))
    spiked = {i: max(max(mb.values()) for mb in schedule[i]) for i in range(ran)}
    return {"iterations": ran, "seconds": time.perf_counter() - began, "calibration": cal, "activation_capacity": activations,
            "reserve_bytes": reserve, "device_cap_bytes": cap, "resident_bytes": resident,
            "spikes": {i: x for i, x in spiked.items() if x > spikes.normal_max_imbalance}, "policies": rows, "skipped": skipped}


def payoff_text(dev: Device, part: dict) -> str:
    cal = part["calibration"]
    where = (f"the allocator's cap {fmt_bytes(part['device_cap_bytes'])} (set_per_process_memory_fraction) = every run's "
             f"weights and optimizer state {fmt_bytes(part['resident_bytes'])} + reserve {fmt_bytes(part['reserve_bytes'])} "
             "+ the activation capacity; an OOM is the allocator's torch.OutOfMemoryError") if dev.cuda else \
        "the Ledger's simulated capacity (an OOM is its SimulatedOutOfMemoryError)"
    lines = [
        f"1. payoff: {part['iterations']} iterations of every policy, spikes in iterations "
        + ", ".join(f"{i} ({x:.2f}x)" for i, x in part["spikes"].items()) + f"; {part['seconds']:.0f} s",
        f"activation capacity {fmt_bytes(part['activation_capacity'])}, between the unbounded run's peak at the normal band's top "
        f"({fmt_bytes(cal['normal'])}) and with one 2.6x micro-batch ({fmt_bytes(cal['spike'])}); enforced by {where}",
    ]
    rows = [
        [r["policy"], r["steps_completed"], r["ooms"], f"{r['tokens_per_s']:.0f}",
         *("-" if r[k] is None else f"{r[k]:.2f}x" for k in ("vs_full_recompute", "vs_oracle", "vs_unbounded")),
         _spread(r["iteration_s"]), fmt_bytes(r["peak_device_bytes"]),
         fmt_bytes(r["allocator_peak_bytes"]) if dev.cuda else "-", f"{r['planner_ms_per_micro_batch']:.2f}",
         r["missed_forwards"] if r["policy"] in PLANNED else "-"]
        for r in part["policies"]
    ] + [[name, *["-"] * 11] for name in part["skipped"]]
    headers = ["policy", "steps", "OOMs", "tokens/s", "vs full recompute", "vs oracle", "vs unbounded",
               "s/iteration median (min-max)", "activation peak", "allocator peak", "planner ms/mb", "missed forwards"]
    skipped = "".join(f"\n{name}: {why}" for name, why in part["skipped"].items())
    return "\n".join(lines) + "\n" + table(headers, rows) + skipped


# ---------------------------------------------------------------- 2. tax


def tax(dev: Device, mode: Mode, iterations: int, recipe: Recipe, cost, batches: list) -> dict:
    """`overhead._alternate` on this model at an ample capacity (`overhead._ample`), the device
    waited for at each iteration's start and end."""
    ample = _ample(recipe, cost)
    r = _alternate(lambda: rank_model(ample.model, device=dev.device), batches, ample, iterations, barrier=dev.settle, slowest=dev.settled)
    plugin, plain = (statistics.median(r["times"][k]) for k in ("plugin", "plain"))
    ratios = [b / a for a, b in zip(r["times"]["plugin"], r["times"]["plain"])]
    share = r["planner_s_per_micro_batch"] * r["micro_batches"] / plugin
    return {"iterations": iterations, "seconds_plugin": plugin, "seconds_plain": plain, "ratio": plain / plugin, "ratio_min": min(ratios),
            "ratio_max": max(ratios), "planner_share": share, "mitigated_micro_batches": r["mitigated_micro_batches"], "times": r["times"]}


def tax_text(part: dict) -> str:
    row = [f"{part['seconds_plugin']:.3f}", f"{part['seconds_plain']:.3f}", f"{part['ratio']:.3f}x",
           f"{part['ratio_min']:.2f}-{part['ratio_max']:.2f}x", f"{100 * part['planner_share']:.2f}%", part["mitigated_micro_batches"]]
    return (f"2. tax at ample capacity: {part['iterations']} iterations each, plugin and plain alternating\n"
            + table(["s/iteration, plugin", "s/iteration, plain", "plugin / plain tokens/s", "per-iteration spread", "planner share",
                     "mitigated mbs"], [row]))


# ---------------------------------------------------------------- 3. dual batch


def copy_overlap(events: list[dict]) -> dict:
    """Of the copies between device and host on side streams (those no kernel runs on: the host
    pool's), the share of their time that kernels cover (the kernels' intervals merged first)."""
    kernels = _intervals(events, lambda e: e.get("cat") == "kernel")
    compute = {stream for _, _, stream in kernels}
    copies = [c for c in _intervals(events, lambda e: e.get("cat") == "gpu_memcpy" and ("DtoH" in e["name"] or "HtoD" in e["name"]))
              if c[2] not in compute]
    busy: list[list[float]] = []  # when any kernel runs: disjoint, in order
    for a, b, _ in sorted(kernels):
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    starts, hidden = [a for a, _ in busy], 0.0
    for a, b, _ in copies:
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(busy) and busy[i][0] < b:
            hidden += max(0.0, min(b, busy[i][1]) - max(a, busy[i][0]))
            i += 1
    total = sum(b - a for a, b, _ in copies)
    return {"copies": len(copies), "copy_ms": total / 1e3, "hidden": hidden / total if total else None}


class _Copy:
    """One copy of the model under `bgl.apply(recipe)`, from the weights `start`, run by
    `interleave` as a `PolicyRun` is (without the optimizer step: every iteration trains the same
    weights); `times` are its iterations', the device waited for at both ends."""

    current = "adaptive"

    def __init__(self, dev: Device, recipe: Recipe, cost, batches: list, start: dict):
        self.dev, self.batches, self.times = dev, batches, []
        self.model = rank_model(recipe.model, device=dev.device)
        self.model.load_state_dict(start)
        self.provisioner = apply(self.model, recipe, cost)

    def iteration(self, it: int) -> None:
        self.dev.settle()
        begin = time.perf_counter()
        run_iteration(self.model, self.batches, self.provisioner.stage.schedule, self.provisioner)
        self.times.append(self.dev.settled(time.perf_counter() - begin))
        self.model.zero_grad(set_to_none=True)

    def profiled(self) -> dict:
        """One more iteration under the torch profiler (CUDA activity): `copy_overlap` of its trace."""
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            run_iteration(self.model, self.batches, self.provisioner.stage.schedule, self.provisioner)
            self.dev.settle()
        self.model.zero_grad(set_to_none=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                return copy_overlap(json.load(f)["traceEvents"])


def dual_batch(dev: Device, mode: Mode, iterations: int, cost, batches: list, start: dict, normal_peak: float, reserve: int) -> dict:
    """The adaptive plans unfused and fused (`pipeline.dual_batch`), two copies taking turns, at
    `TIGHT` of the normal band's activation peak and balanced routing; then one iteration of each
    profiled on a GPU."""
    activations = int(TIGHT * normal_peak)
    recipes = [make_recipe(mode, activations, reserve, dual_batch=fused, offload_only=True) for fused in (False, True)]
    copies = [_Copy(dev, recipe, cost, batches, start) for recipe in recipes]
    began = time.perf_counter()
    try:
        ran, _ = interleave(dev, copies, iterations, mode.budget_s["dual batch"])
        overlap = [copy.profiled() if dev.cuda else None for copy in copies]
    finally:
        for copy in copies:
            copy.provisioner.remove()
    events = [list(copy.provisioner.events) for copy in copies]
    points = [e.point for e in events[1] if e.point is not None]
    names = ("unfused 1F1B", "fused dual-batch")
    return {
        "iterations": ran, "seconds": time.perf_counter() - began, "activation_capacity": activations,
        "strategies": sorted({s for e in events[0] + events[1] for s in e.plan.values()}),
        "fused_points": len(points), "recovered_ahead": sum(p.recovered is not None for p in points),
        "predicted_point": statistics.median(p.serial_s / p.predicted_s for p in points) if points else None,
        "schedules": [{"schedule": n, "iteration_s": c.times[1:ran], "overlap": o} for n, c, o in zip(names, copies, overlap)],
        "ratios": [u / f for u, f in zip(copies[0].times[1:ran], copies[1].times[1:ran])],  # after a warm-up
    }


def dual_batch_text(dev: Device, part: dict) -> str:
    ratios = part["ratios"]
    rows = []
    for k, s in enumerate(part["schedules"]):
        o = s["overlap"]
        hidden = "not measurable on CPU (no streams)" if not dev.cuda else "no copies" if o["hidden"] is None else \
            f"{o['hidden']:.0%} of {o['copy_ms']:.1f} ms ({o['copies']} copies)"
        vs = f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})" if k else "1.000x"
        rows.append([s["schedule"], _spread(s["iteration_s"]), vs, hidden])
    predicted = "-" if part["predicted_point"] is None else f"{part['predicted_point']:.2f}x"
    return (f"3. dual batch: {part['iterations']} iterations each, activation capacity {fmt_bytes(part['activation_capacity'])}, "
            f"plans: {', '.join(part['strategies']) or 'none'}; {part['fused_points']} fused points, {part['recovered_ahead']} "
            f"recovering y+1 ahead, the DP's predicted point speed-up {predicted}; {part['seconds']:.0f} s\n"
            + table(["schedule", "s/iteration median (min-max)", "vs unfused (per iteration)", "offload copy time hidden under compute"],
                    rows))


# ---------------------------------------------------------------- 4. time error


class _NodeClock(_Provenance):
    """The profiler's attribution of each autograd node to the op whose forward made it, each
    node's backward timed on the device's clock."""

    def __init__(self, tracker, dev: Device):
        super().__init__(tracker, backward_s={})
        self.dev, self.spans = dev, []

    def _time(self, node, op) -> None:
        self._timed.add(id(node))
        span = [op, None, None]
        self.spans.append(span)

        def begin(_grad_outputs):
            span[1] = self.dev.stamp()

        def end(_grad_inputs, _grad_outputs):
            span[2] = self.dev.stamp()

        node.register_prehook(begin)
        node.register_hook(end)


def op_times(dev: Device, model, ids: torch.Tensor, repeats: int) -> tuple[dict, dict, dict]:
    """Each op's forward and backward seconds in one micro-batch, summed over the layers, medians
    of `repeats` after a warm-up: forward from one op scope's start to the next (as `bgl.profile`
    times it), backward around each autograd node; and the local routed pairs per MoE layer."""
    runs = {"forward": [], "backward": []}
    with _instrumented(Adapter(model)) as (tracker, monitor):
        for r in range(repeats + 1):
            marks = []
            tracker.listeners.append(lambda op, marks=marks: marks.append((op.name, dev.stamp())))
            try:
                loss = model(input_ids=ids, labels=ids).loss
                marks.append((None, dev.stamp()))
            finally:
                tracker.listeners.pop()
            loss.backward()
            with _NodeClock(tracker, dev) as clock:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            dev.settle()
            forward, backward = defaultdict(float), defaultdict(float)
            for (name, a), (_, b) in zip(marks, marks[1:]):
                forward[name] += dev.seconds(a, b)
            for op, a, b in clock.spans:
                if op is not None and a is not None and b is not None:  # ops outside every scope aside
                    backward[op.name] += dev.seconds(a, b)
            if r:
                runs["forward"].append(forward)
                runs["backward"].append(backward)
        routed = monitor.local_pairs()
    model.zero_grad(set_to_none=True)
    median = {k: {name: statistics.median(run.get(name, 0.0) for run in v) for name in v[0]} for k, v in runs.items()}
    return median["forward"], median["backward"], routed


def time_error(dev: Device, mode: Mode, recipe: Recipe, cost, batches: list, start: dict) -> dict:
    """The analytic cost model (the plans') and `bgl.profile`'s fit against `op_times`."""
    model = rank_model(recipe.model, device=dev.device)
    model.load_state_dict(start)
    ids = batches[0]
    with frozen():
        forward, backward, routed = op_times(dev, model, ids, mode.repeats)
    tokens = ids.numel()
    profiled = profile(model, [tokens // 4, tokens // 2, tokens], repeats=1)  # as `demo.model.demo_cost` profiles
    pairs = [routed[layer] for layer in cost.moe_layers]
    predicted = {}
    for name, cm in (("analytic", cost), ("profiled", profiled)):
        sums = defaultdict(lambda: [0.0, 0.0])
        for c in cm.op_costs(Forward(ids.numel(), ids.shape[-1], pairs)):
            sums[c.op.name][0] += c.forward_s
            sums[c.op.name][1] += c.backward_s
        predicted[name] = sums
    rows = []
    for op in [*forward, "total"]:
        measured = (sum(forward.values()), sum(backward.values())) if op == "total" else (forward[op], backward.get(op, 0.0))
        row = {"op": op, "measured_forward_s": measured[0], "measured_backward_s": measured[1]}
        for name, sums in predicted.items():
            f, b = (sum(v[0] for v in sums.values()), sum(v[1] for v in sums.values())) if op == "total" else sums.get(op, (0.0, 0.0))
            row[f"{name}_forward_s"], row[f"{name}_backward_s"] = f, b
        rows.append(row)
    return {"tokens": ids.numel(), "seq_len": ids.shape[-1], "repeats": mode.repeats, "rows": rows}


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}" if measured > 0 else "-"


def time_error_text(dev: Device, part: dict) -> str:
    clock = "CUDA events" if dev.cuda else "perf_counter"
    rows = [
        [r["op"], *(cell for kind in ("forward", "backward") for cell in (
            f"{1e3 * r[f'measured_{kind}_s']:.3f}", _error(r[f"analytic_{kind}_s"], r[f"measured_{kind}_s"]),
            _error(r[f"profiled_{kind}_s"], r[f"measured_{kind}_s"])))]
        for r in part["rows"]
    ]
    return (f"4. time error: one micro-batch of {part['tokens']} tokens, nothing mitigated, {clock}, medians of {part['repeats']}; "
            "error = (predicted - measured) / measured, per op summed over the layers (dispatch and combine: copies here)\n"
            + table(["op", "forward ms", "analytic", "profiled", "backward ms", "analytic", "profiled"], rows))


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the same steps, small, on the CPU (what CI runs)")
    parser.add_argument("--iterations", type=int, default=None, help="iterations per part at most (default: 40 on a GPU, 3 with --cpu)")
    parser.add_argument("--json", default=None, help="also write every part's numbers as JSON")
    parser.add_argument("--png", default=None, help="also draw the payoff's device memory, step by step, per policy")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds the parts' time budgets add up to (default: 285 on a GPU, 40 with --cpu), shared as they are")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("--cpu: no CUDA device here; --cpu runs the same steps small on the CPU")
    mode = CPU if args.cpu else GPU
    if args.budget is not None:
        if args.budget <= 0:
            parser.error(f"--budget must be > 0 seconds, got {args.budget}")
        scale = args.budget / sum(mode.budget_s.values())
        mode = replace(mode, budget_s={part: scale * s for part, s in mode.budget_s.items()})
    iterations = mode.iterations if args.iterations is None else args.iterations
    if iterations < MIN_ITERATIONS:
        parser.error(f"--iterations must be >= {MIN_ITERATIONS} (iteration {FORCED_SPIKE[0]} spikes), got {iterations}")
    dev = Device(torch.device("cuda", torch.cuda.current_device()) if mode.name == "cuda" else torch.device("cpu"))
    began = time.perf_counter()
    name = dev.name
    print(f"{name}, torch {torch.__version__}: rank 0 of {EP} expert-parallel ranks, the other {EP - 1} emulated mirrors of it "
          "(the hot rank's memory, compute and plans; the all-to-alls are copies on this device; see the docstring)")
    out = {"device": name, "mode": mode.name, "ep": EP, "model": mode.model, "batch": mode.batch, "micro_batches": mode.micro_batches}
    with mirrored(EP):
        recipe = make_recipe(mode, 1 << 50)
        batches = [b.to(dev.device) for b in rank_batches(recipe, 0)]
        start = pretrained(Stage.of(recipe, split=False), batches)  # on the batches' device
        cost = model_cost(rank_model(recipe.model, device=dev.device), recipe.hardware)  # the analytic model: the plans'
        out["payoff"] = payoff(dev, mode, iterations, cost, batches, start, args.png)
        print("\n" + payoff_text(dev, out["payoff"]), flush=True)
        per_iteration = statistics.median(next(r for r in out["payoff"]["policies"] if r["policy"] == "unbounded")["iteration_s"])
        reserve = out["payoff"]["reserve_bytes"]
        runs = max(MIN_ITERATIONS, min(iterations, int(mode.budget_s["tax"] / (2 * per_iteration))))
        out["tax"] = tax(dev, mode, runs, make_recipe(mode, 1 << 50, reserve), cost, batches)
        print("\n" + tax_text(out["tax"]), flush=True)
        normal = out["payoff"]["calibration"]["normal"]
        out["dual_batch"] = dual_batch(dev, mode, iterations, cost, batches, start, normal, reserve)
        print("\n" + dual_batch_text(dev, out["dual_batch"]), flush=True)
        out["time_error"] = time_error(dev, mode, recipe, cost, batches, start)
        print("\n" + time_error_text(dev, out["time_error"]), flush=True)
    out["seconds"] = time.perf_counter() - began
    print(f"\n{out['seconds']:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
