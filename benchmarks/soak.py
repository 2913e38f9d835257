"""Soak: the adaptive system over many micro-batches with routing spikes, on the demo's model and
expert-parallel ranks (the built-in `demo` recipe, its capacity), checking that nothing grows.

Every rank runs `bgl.apply` as pipeline rank 0 of the recipe's 1F1B schedule, at a capacity
below the recipe's (`--capacity-scale`, so that every micro-batch is mitigated), its plans
offloading (at any size, so the host pool serves every copy; the gates still escalate by
recomputing the experts), with spikes drawn
by `spikes.imbalance_schedule` (the recipe's spike rate, or `--spike-probability`) onto rank 0's
experts, AdamW after each iteration. After a warm-up it reads, per rank:
- the host pool: buffers made (a reused buffer is not made again) and its most free bytes;
- telemetry: one JSON line per micro-batch in the rank's file;
- the project's live objects (and how many plans the per-plan caches hold, each bounded by
  `costmodel.plan.PLANS_CACHED`) and the traced Python heap (`tracemalloc`, started before the
  warm-up), at the end of the warm-up and at the end, the telemetry deque cleared each iteration;
- the Ledger's live bytes after each iteration (nothing of the last one may stay), the OOMs and
  the gates' decisions.

    python benchmarks/soak.py [--micro-batches-total 1000] [--ranks 2] [--json FILE]   (~10 min on 2 cores)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import tracemalloc
from contextlib import ExitStack
from pathlib import Path

import torch

import bagualu_plugin as bgl
from bagualu_plugin.adapters import Adapter
from bagualu_plugin.adapters.gate import RoutingSkew
from bagualu_plugin.demo.model import LEARNING_RATE, rank_batches, rank_model, train_step
from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.report import table
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.spikes import imbalance_schedule, skew_fraction

WARMUP = 10  # iterations


def _ours() -> int:
    return sum(str(getattr(type(o), "__module__", "")).startswith("bagualu_plugin") for o in gc.get_objects())


def _soak(rank: int, size: int, iterations: int, spike_probability: float | None, scale: float, telemetry_dir: str) -> dict:
    torch.set_num_threads(1)
    recipe = bgl.load_recipe("demo")
    telemetry = Path(telemetry_dir) / f"rank{rank}.jsonl"
    spikes = recipe.spikes if spike_probability is None else recipe.spikes.model_copy(update={"spike_probability": spike_probability})
    capacity = int(recipe.hardware.capacity_bytes * scale)
    recipe = recipe.model_copy(update={
        "hardware": recipe.hardware.model_copy(update={"capacity_bytes": capacity}),
        "parallel": recipe.parallel.model_copy(update={"ep": size, "dp": size, "ep_rank": rank}),
        "telemetry": recipe.telemetry.model_copy(update={"path": str(telemetry)}),
        "spikes": spikes,
        # offload (the demo recipe recomputes), so that every plan goes through the host pool
        "strategies": recipe.strategies.model_copy(update={
            "allowed": ["offload"], "offload": recipe.strategies.offload.model_copy(update={"min_bytes": 0}),
        }),
    })
    model = rank_model(recipe.model)
    prov = bgl.apply(model, recipe)
    prov.ledger.on_overrun = "record"  # an overrun on one rank must not leave the others in a collective
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    batches, adapter = rank_batches(recipe, rank), Adapter(model)
    schedule = imbalance_schedule(spikes, iterations, recipe.pipeline.micro_batches, [layer.index for layer in adapter.layers if layer.moe])
    pool = prov.runtime.hooks.pool
    counts = {"escalate": 0, "collective": 0, "defer": 0, "overruns": 0}
    left: list[int] = []
    marks: dict[str, tuple] = {}

    def cached() -> int:  # plans the per-plan caches hold (each keeps the PLANS_CACHED most recent)
        return prov.decider._escalated.cache_info().currsize + prov.runtime._regions_for.cache_info().currsize

    def skew(it: int):
        def around(step):
            stack = ExitStack()
            for layer, x in schedule[it][step.micro_batch].items():
                stack.enter_context(RoutingSkew(adapter, skew_fraction(min(x, size), size), size, 0, layers=[layer]))
            return stack
        return around

    tracemalloc.start()  # before warm-up: what steady state reuses was allocated under tracing too
    start = time.perf_counter()
    for it in range(iterations):
        if it == WARMUP:
            gc.collect()
            marks["warm"] = (_ours(), tracemalloc.get_traced_memory()[0], pool.made, time.perf_counter(), cached())
        run_iteration(model, batches, prov.stage.schedule, prov, around=skew(it))
        train_step(model, optimizer)
        for event in prov.events:
            counts["escalate"] += sum(not x.collective for x in event.escalations)
            counts["collective"] += sum(x.collective for x in event.escalations)
            counts["defer"] += len(event.deferred)
        prov.events.clear()
        counts["overruns"] += prov.ledger.take_overrun() is not None
        left.append(prov.ledger.live_device_bytes + prov.ledger.live_host_bytes)
        marks["free"] = max(marks.get("free", (0,)), (pool.free_bytes,))
    gc.collect()
    end = (_ours(), tracemalloc.get_traced_memory()[0], pool.made, time.perf_counter(), cached())
    tracemalloc.stop()
    prov.remove()
    lines = telemetry.read_text().splitlines()
    warm = marks["warm"]
    return dict(
        rank=rank,
        micro_batches=iterations * recipe.pipeline.micro_batches,
        telemetry_lines=len(lines),
        buffers_made=(warm[2], end[2]),
        most_free_bytes=marks["free"][0],
        objects=(warm[0], end[0]),
        cached_plans=(warm[4], end[4]),
        heap=(warm[1], end[1]),
        left_after_iterations=max(left),
        seconds=end[3] - start,
        **counts,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches-total", type=int, default=1000, help="per rank (a multiple of the recipe's micro-batches)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--spike-probability", type=float, default=None, help="per iteration (default: the demo recipe's)")
    parser.add_argument("--capacity-scale", type=float, default=0.7, help="of the demo recipe's capacity: every plan mitigates")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    per_iteration = bgl.load_recipe("demo").pipeline.micro_batches
    if args.micro_batches_total % per_iteration or args.micro_batches_total // per_iteration <= WARMUP:
        parser.error(f"--micro-batches-total must be a multiple of {per_iteration} above {WARMUP * per_iteration}")
    with tempfile.TemporaryDirectory() as telemetry:
        results = run_ranks(
            _soak, args.ranks, args.micro_batches_total // per_iteration, args.spike_probability, args.capacity_scale, telemetry,
            timeout_s=600,
            deadline_s=7200,
        )
    headers = ["rank", "micro-batches", "telemetry lines", "pool buffers (warm -> end)", "most free (KiB)",
               "live objects (warm -> end)", "of them cached plans", "heap KiB (warm -> end)", "left after an iteration",
               "gates: escalate / collective / defer",
               "overruns", "seconds"]
    rows = [
        [r["rank"], r["micro_batches"], r["telemetry_lines"], f"{r['buffers_made'][0]} -> {r['buffers_made'][1]}",
         f"{r['most_free_bytes'] / 1024:.0f}", f"{r['objects'][0]} -> {r['objects'][1]}",
         f"{r['cached_plans'][0]} -> {r['cached_plans'][1]}", f"{r['heap'][0] / 1024:.0f} -> {r['heap'][1] / 1024:.0f}",
         r["left_after_iterations"],
         f"{r['escalate']} / {r['collective']} / {r['defer']}", r["overruns"], f"{r['seconds']:.0f}"]
        for r in results
    ]
    print(table(headers, rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
