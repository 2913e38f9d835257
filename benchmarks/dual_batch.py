"""Fused dual-batch execution (paper §V-B), as the planner predicts it on the paper's presets.

For every Table II preset (`recipes/bagualu/cluster/`), pipeline rank 0 at balanced routing, its
first model chunk (the presets interleave vp chunks per rank, and every forward is one chunk):
Algorithm 1's steady budget (the capacity left after the static bytes, over the chunk forwards in
flight), Algorithm 2's plan for it, then one steady scheduling point F_x B_y whose four classes
(forward of x, backward of y, offload of x-1, recovery of y+1) all run that plan
(`planner.dual_batch.point_stages`),
solved one transformer block at a time (`solve_blocks`). Printed per preset: the point's predicted time with the
classes one after another and in the DP's fused order, their ratio, the iteration's ratio (the
steps outside the rank's fused points stay unfused), and the DP's solve time uncached and
through the cache over 100 iterations' steady points. All predicted by the cost model: nothing
here runs a model. The fused time is a bound: `window_time` overlaps a class's all-to-alls and
copies with the others' compute on a stream of their own, without contention, and the unfused
point overlaps nothing (its classes one after another, each a chain).

Then measured: the executor (`runtime.dual_batch`) against the unfused 1F1B driver on CPU, with
real expert parallelism over 2 gloo processes of one thread each (a tiny GLM-4-MoE, pipeline
rank 0 of 4, 8 micro-batches, plans that recompute and offload), the executor twice: each
all-to-all of a point's forward waited on at once, and waited on only after the backward or
recovery piece the schedule put beside it (`pipeline.overlap_all_to_all`, the default). The
modes take turns iteration by iteration on copies of the model; printed: each iteration's time
that of the slower rank (its median and spread over the iterations), each rank's CPU time and the
seconds its points' forwards waited on their all-to-alls, and the DP's cache over the run. The collector
is frozen after set-up and every rank collects between iterations (`collector.ManualCollector`):
a full collection of the whole heap (0.16-0.18 s here) on either rank stalls both at the next
all-to-all, and the unfused run, which allocates a whole forward at once, triggered them about
twice as often. gloo's worker threads move an all-to-all's rows while the
Python thread runs the work beside it, but on 2 cores the two ranks' compute already fills both,
so what the work beside an exchange saves here is mostly the wait for the other rank to arrive.

    python benchmarks/dual_batch.py [--iterations 32]   (about 75 s on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bagualu_plugin import apply, expert_parallel
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.collector import ManualCollector
from bagualu_plugin.config import Recipe, builtin_recipes, load_recipe
from bagualu_plugin.costmodel import ModelDims
from bagualu_plugin.costmodel.pipeline import fused_points
from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.planner import plan_micro_batch
from bagualu_plugin.planner.dual_batch import ScheduleCache, joined, point_stages, solve_blocks, window_time
from bagualu_plugin.report import table
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.stage import Stage
from bagualu_plugin.units import fmt_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=32, help="measured iterations per schedule (after one warm-up each)")
    args = parser.parse_args()
    if args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    presets = sorted(name for name in builtin_recipes() if name.startswith("glm-"))
    rows = []
    for name in presets:
        rank = Stage.of(load_recipe(name))
        stage = rank.chunk(0)
        recipe, cm, seq = stage.recipe, stage.cost, stage.recipe.batch.seq_len
        budget = (stage.capacity - stage.static_bytes) / stage.warmup
        plan = plan_micro_batch(cm, budget, stage.tokens, seq_len=seq, strategies=recipe.strategies.allowed).plan
        blocks = point_stages(cm, plan, plan, plan, plan, stage.tokens, seq_len=seq)
        stages = joined(blocks)
        start = time.perf_counter()
        schedule = solve_blocks(blocks)
        uncached = time.perf_counter() - start
        points = fused_points(rank.schedule)
        steady = sum(b is not None for _, b in points)  # fused points on rank 0
        cache = ScheduleCache(rank.chunks, stage.options)
        start = time.perf_counter()
        for _ in range(100 * steady):  # one miss, then hits: budgets repeat with the phase (§V-B)
            cache.get(stage.tokens, seq, (0, 0, 0, 0), [plan] * 4)
        amortised = (time.perf_counter() - start) / (100 * steady)
        serial = schedule.serial_s
        alone = {"F": window_time([stages[0]]), "B": window_time([stages[1]])}
        edges = sum(alone[step.kind] for step, b in points if b is None)  # warmup forwards, cooldown backwards
        rows.append([
            name, f"{len(plan)}", fmt_seconds(serial), fmt_seconds(schedule.time_s), f"{serial / schedule.time_s:.2f}x",
            f"{(edges + steady * serial) / (edges + steady * schedule.time_s):.2f}x", fmt_seconds(uncached), fmt_seconds(amortised),
        ])
    print("predicted by the cost model (pipeline rank 0, chunk 0, balanced routing; a bound, see the docstring); paper: 1.13x (L3 -> L4)")
    print(table(["preset", "ops planned", "point serial", "point fused", "point", "iteration", "DP uncached", "DP cached"], rows))

    measured(args.iterations)


MODES = {  # name: (dual_batch, pipeline.overlap_all_to_all)
    "unfused 1F1B": (False, None),
    "fused, all-to-alls waited at once": (True, False),
    "fused, backward beside the all-to-alls": (True, None),
}


def _rank(rank: int, size: int, iterations: int) -> dict:
    """One expert-parallel rank: the modes' iterations taking turns, on copies of the model (same
    weights), each with its Provisioner."""
    torch.set_num_threads(1)  # a core per process: two ranks of two threads each on two cores thrash
    batch, seq, m = 2, 64, 8

    def make():
        model = tiny_model("glm4_moe", num_hidden_layers=4, hidden_size=128, moe_intermediate_size=64, intermediate_size=256)
        model.set_experts_implementation("bagualu")
        expert_parallel(model)
        return model

    model = make()
    keep = model_cost(model).activation_bytes(batch * seq, seq_len=seq)
    recipe = Recipe.from_dict({
        "hardware": {"preset": "cpu", "capacity_bytes": int(2.4 * keep)},
        "model": ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa").model_dump(),
        "parallel": {"ep": size, "ep_rank": rank, "dp": size},
        "pipeline": {"pp": 4, "rank": 0, "micro_batches": m},
        "batch": {"seq_len": seq, "micro_batch_size": batch},
        "budget": {"non_activation_bytes": 0},
        "strategies": {"allowed": ["recompute", "offload"], "offload": {"min_bytes": 0}},
    })
    runs = {}
    for name, (fused, overlap) in MODES.items():
        copy = model if not runs else make()
        pipeline = recipe.pipeline.model_copy(update={"dual_batch": fused, "overlap_all_to_all": overlap})
        runs[name] = copy, apply(copy, recipe.model_copy(update={"pipeline": pipeline}))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, model.config.vocab_size, (batch, seq), generator=g) for _ in range(m)]
    times, cpu, waited = ({name: [] for name in MODES} for _ in range(3))
    with ManualCollector() as collector:
        for it in range(iterations + 1):  # the first of each: warm-up
            for name, (run, prov) in runs.items():
                torch.distributed.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                run_iteration(run, batches, prov.stage.schedule, prov)
                run.zero_grad(set_to_none=True)
                if it:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
                    waited[name].append(sum(e.point.waited_s for e in list(prov.events)[-m:] if e.point))
                collector.step()  # every rank, between the timed iterations
    prov = runs["fused, backward beside the all-to-alls"][1]
    points = [e.point for e in prov.events if e.point]
    strategies = sorted({s for e in prov.events for s in e.plan.values()})
    return {
        "times": times, "cpu": {name: statistics.median(c) for name, c in cpu.items()},
        "waited": {name: statistics.median(w) for name, w in waited.items()}, "strategies": strategies,
        "hit_rate": sum(p.cache_hit for p in points) / len(points), "points": len(points),
        "predicted": statistics.median(p.serial_s / p.predicted_s for p in points),
        "recovered": sum(p.recovered is not None for p in points),
        "exchanges": points[-1].exchanges, "beside": points[-1].beside,
    }


def measured(iterations: int) -> None:
    ranks = run_ranks(_rank, 2, iterations, timeout_s=600 + 45 * iterations)
    # each iteration's time is the slower rank's
    slowest = {name: [max(t) for t in zip(*(r["times"][name] for r in ranks))] for name in MODES}
    median = {name: statistics.median(t) for name, t in slowest.items()}
    r, unfused = ranks[0], next(iter(MODES))
    print(f"\nmeasured on CPU: 2 expert-parallel gloo processes, pipeline rank 0 of 4, 8 micro-batches, plans: "
          f"{', '.join(r['strategies'])}; {r['points']} fused points, {r['recovered']} with y+1 recovered ahead; "
          f"DP cache hit rate {r['hit_rate']:.0%}; {iterations} iterations each, collector frozen; at a point x's forward "
          f"issues {r['exchanges']} all-to-alls, and {', '.join(r['beside'])} ran beside them (the last point)")
    rows = []
    for name in MODES:
        t = slowest[name]
        paired = [u / v for u, v in zip(slowest[unfused], t)]  # the modes take turns: iteration i of each, side by side
        low, *_, high = statistics.quantiles(paired, n=10) if len(paired) > 1 else paired * 2
        rows.append([
            name, f"{median[name]:.3f}", f"{min(t):.3f}-{max(t):.3f}", f"{median[unfused] / median[name]:.2f}x",
            f"{statistics.median(paired):.2f}x ({low:.2f}-{high:.2f}x)",
            " / ".join(f"{q['cpu'][name]:.3f}" for q in ranks),
            " / ".join(f"{1e3 * q['waited'][name]:.1f}" for q in ranks) if name != unfused else "-",
            f"{r['predicted']:.2f}x" if name != unfused else "-",
        ])
    print(table(
        ["schedule", "s / iteration (median)", "min-max", "vs unfused", "vs unfused, per iteration: median (p10-p90)",
         "CPU s / iteration, rank 0 / 1 (median)",
         "ms waited on the points' forward all-to-alls, rank 0 / 1", "predicted point (cost model, CPU preset)"],
        rows,
    ))


if __name__ == "__main__":
    main()
