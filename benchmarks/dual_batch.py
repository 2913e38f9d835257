"""Fused dual-batch execution (paper §V-B), as the planner predicts it on the paper's presets.

For every Table II preset (`recipes/bagualu/cluster/`), pipeline rank 0 at balanced routing:
Algorithm 1's steady budget (the capacity left after the static bytes, over the micro-batches in
flight), Algorithm 2's plan for it, then one steady scheduling point F_x B_y whose four classes
(forward of x, backward of y, offload of x-1, recovery of y+1) all run that plan
(`planner.dual_batch.point_stages`),
solved one transformer block at a time (`solve_blocks`). Printed per preset: the point's predicted time with the
classes one after another and in the DP's fused order, their ratio, the iteration's ratio (the
warmup forwards and cooldown backwards stay unfused), and the DP's solve time uncached and
through the cache over 100 iterations' steady points. All predicted by the cost model: nothing
here runs a model. The fused time is a bound: `window_time` overlaps a class's all-to-alls and
copies with the others' compute on a stream of their own, without contention, and the unfused
point overlaps nothing (its classes one after another, each a chain).

    python benchmarks/dual_batch.py
"""

from __future__ import annotations

import time

from bagualu_plugin.config import builtin_recipes, load_recipe
from bagualu_plugin.planner import plan_micro_batch
from bagualu_plugin.planner.dual_batch import ScheduleCache, joined, point_stages, solve_blocks, window_time
from bagualu_plugin.report import table
from bagualu_plugin.stage import Stage
from bagualu_plugin.units import fmt_seconds


def main() -> None:
    presets = sorted(name for name in builtin_recipes() if name.startswith("glm-"))
    rows = []
    for name in presets:
        stage = Stage.of(load_recipe(name))
        recipe, cm, seq = stage.recipe, stage.cost, stage.recipe.batch.seq_len
        budget = (stage.capacity - stage.static_bytes) / stage.warmup
        plan = plan_micro_batch(cm, budget, stage.tokens, seq_len=seq, strategies=recipe.strategies.allowed).plan
        blocks = point_stages(cm, plan, plan, plan, plan, stage.tokens, seq_len=seq)
        stages = joined(blocks)
        start = time.perf_counter()
        schedule = solve_blocks(blocks)
        uncached = time.perf_counter() - start
        steady = recipe.pipeline.micro_batches - recipe.pipeline.pp  # steady points on rank 0
        cache = ScheduleCache(lambda key, blocks=blocks: blocks)
        start = time.perf_counter()
        for _ in range(100 * steady):  # one miss, then hits: budgets repeat with the phase (§V-B)
            cache.get((round(budget), 0, "steady"))
        amortised = (time.perf_counter() - start) / (100 * steady)
        serial = schedule.serial_time(stages)
        edges = recipe.pipeline.pp * (window_time([stages[0]]) + window_time([stages[1]]))  # warmup F, cooldown B
        rows.append([
            name, f"{len(plan)}", fmt_seconds(serial), fmt_seconds(schedule.time_s), f"{serial / schedule.time_s:.2f}x",
            f"{(edges + steady * serial) / (edges + steady * schedule.time_s):.2f}x", fmt_seconds(uncached), fmt_seconds(amortised),
        ])
    print("predicted by the cost model (pipeline rank 0, balanced routing; a bound, see the docstring); paper: 1.13x (L3 -> L4)")
    print(table(["preset", "ops planned", "point serial", "point fused", "point", "iteration", "DP uncached", "DP cached"], rows))


if __name__ == "__main__":
    main()
