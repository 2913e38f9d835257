"""Soak: the adaptive system over many micro-batches with routing spikes, on the demo's model and
expert-parallel ranks (the built-in `demo` recipe, its capacity), checking that nothing grows.

Every rank runs `bgl.apply` as pipeline rank 0 of the recipe's 1F1B schedule, at a capacity
below the recipe's (`--capacity-scale`, so that every micro-batch is mitigated), its plans
offloading (at any size, so the host pool serves every copy; the gates still escalate by
recomputing the experts), with spikes drawn
by `spikes.imbalance_schedule` (the recipe's spike rate, or `--spike-probability`) onto rank 0's
experts, AdamW after each iteration. After a warm-up it reads, per rank:
- the host pool: buffers made (a reused buffer is not made again) and their size classes (every
  buffer is back in the pool between iterations), the micro-batch after which it last made one,
  and its most free bytes;
- telemetry: one JSON line per micro-batch in the rank's file;
- the project's live objects (and how many layer blocks the runtime's regions cache holds) and
  the traced Python heap (`tracemalloc`, started before the warm-up), each after a full
  collection at an iteration's end: at the end of the warm-up, every 100 micro-batches after it
  and at the end (the telemetry deque cleared each iteration), with the lines whose traced
  memory grew most from the end of the warm-up to the end;
- the Ledger's live bytes after each iteration (nothing of the last one may stay), the OOMs and
  the gates' decisions.

    python benchmarks/soak.py [--micro-batches-total 1000] [--ranks 2] [--json FILE]   (~4 min on 2 cores)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import tracemalloc
from array import array
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
EVERY = 100  # micro-batches between readings after the warm-up
GROWTH_SITES = 3  # lines of code named where the traced heap grew most
READINGS = ("objects", "heap", "buffers", "classes", "blocks")


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
    per_iteration = recipe.pipeline.micro_batches
    schedule = imbalance_schedule(spikes, iterations, per_iteration, [layer.index for layer in adapter.layers if layer.moe])
    pool = prov.runtime.hooks.pool
    counts = {"escalate": 0, "collective": 0, "defer": 0, "overruns": 0}
    left = most_free = last_made = 0
    marks = [it for it in range(WARMUP, iterations) if (it - WARMUP) * per_iteration % EVERY == 0] + [iterations]
    # made before tracing starts: recording a reading then allocates nothing that a later one counts
    readings = {name: array("q", bytes(8 * len(marks))) for name in READINGS}
    warm_heap = Path(telemetry_dir) / f"rank{rank}.warm.tracemalloc"

    def read(i: int) -> None:
        gc.collect()
        readings["objects"][i], readings["heap"][i] = _ours(), tracemalloc.get_traced_memory()[0]
        readings["buffers"][i], readings["classes"][i] = pool.made, len({size for _, size in pool._free})
        readings["blocks"][i] = prov.runtime.block_regions.cache_info().currsize

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
        if it in marks:
            read(marks.index(it))
            if it == WARMUP:  # on disk: a snapshot held in memory would count in the heap read at the end
                tracemalloc.take_snapshot().dump(warm_heap)
        made = pool.made
        run_iteration(model, batches, prov.stage.schedule, prov, around=skew(it))
        train_step(model, optimizer)
        if pool.made > made:
            last_made = (it + 1) * per_iteration
        counts["escalate"] += sum(not x.collective for event in prov.events for x in event.escalations)
        counts["collective"] += sum(x.collective for event in prov.events for x in event.escalations)
        counts["defer"] += sum(len(event.deferred) for event in prov.events)
        prov.events.clear()
        counts["overruns"] += prov.ledger.take_overrun() is not None
        left = max(left, prov.ledger.live_device_bytes + prov.ledger.live_host_bytes)
        most_free = max(most_free, pool.free_bytes)
    seconds = time.perf_counter() - start
    read(len(marks) - 1)
    grown = tracemalloc.take_snapshot().compare_to(tracemalloc.Snapshot.load(warm_heap), "lineno")
    tracemalloc.stop()
    prov.remove()
    lines = telemetry.read_text().splitlines()
    return dict(
        rank=rank,
        micro_batches=iterations * per_iteration,
        telemetry_lines=len(lines),
        readings=[dict(micro_batches=m * per_iteration, **{name: readings[name][i] for name in READINGS}) for i, m in enumerate(marks)],
        pool_last_made=last_made,
        most_free_bytes=most_free,
        grown=[(f"{Path(s.traceback[0].filename).name}:{s.traceback[0].lineno}", s.size_diff, s.count_diff)
               for s in grown if s.size_diff > 0][:GROWTH_SITES],
        left_after_iterations=left,
        seconds=seconds,
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
    headers = ["rank", "micro-batches", "telemetry lines", "pool buffers (warm -> end)", "their size classes",
               "pool last grew (micro-batch)", "most free (KiB)", "live objects (warm -> end)", "layer blocks cached",
               "heap KiB (warm -> end)", "left after an iteration", "gates: escalate / collective / defer", "overruns", "seconds"]
    rows = []
    for r in results:
        warm, end = r["readings"][0], r["readings"][-1]
        rows.append([
            r["rank"], r["micro_batches"], r["telemetry_lines"], f"{warm['buffers']} -> {end['buffers']}",
            f"{warm['classes']} -> {end['classes']}", r["pool_last_made"],
            f"{r['most_free_bytes'] / 1024:.0f}", f"{warm['objects']} -> {end['objects']}", f"{warm['blocks']} -> {end['blocks']}",
            f"{warm['heap'] / 1024:.0f} -> {end['heap'] / 1024:.0f}", r["left_after_iterations"],
            f"{r['escalate']} / {r['collective']} / {r['defer']}", r["overruns"], f"{r['seconds']:.0f}",
        ])
    print(table(headers, rows))
    marks = [x["micro_batches"] for x in results[0]["readings"]]
    print("\nAfter the warm-up, at each micro-batch count:\n")
    rows = [
        [r["rank"], name, *(fmt(x[key]) for x in r["readings"])]
        for r in results
        for name, key, fmt in (("heap KiB", "heap", lambda b: f"{b / 1024:.1f}"), ("live objects", "objects", str),
                               ("pool buffers", "buffers", str), ("layer blocks cached", "blocks", str))
    ]
    print(table(["rank", "reading", *map(str, marks)], rows))
    print("\nWhere the traced heap grew most, warm-up to end:")
    for r in results:
        sites = ", ".join(f"{site} {size:+d} B ({count:+d} blocks)" for site, size, count in r["grown"]) or "nowhere"
        print(f"  rank {r['rank']}: {sites}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
