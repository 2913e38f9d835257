"""How long BaGuaLu-2's decisions take (paper §VI-D: under 10 ms per iteration).

1. The Provisioner on the demo's model (`bagualu demo`'s tiny GLM-4-MoE, its recipe and routing
   spikes): per micro-batch, `begin_forward` in all (Algorithm 1's budget, Algorithm 2's plan, the
   gates' room, the plan installed and the forward's hooks entered), and within it the path
   planner (`PathPlanner.answer`), the gates' costs (`gate_costs`: none once a shape's band is
   prepared, which `Decider` does when it is built for the recipe's shape), the runtime install
   (`PlanRuntime.set_plan` and entering `PlanRuntime.forward`) and the Ledger's check that the
   model did not change (`Ledger.refresh_if_changed`, at each iteration's first micro-batch; it
   walks the model only when it did).
   On 4 expert-parallel gloo ranks (the demo's adaptive policy, profiled cost model) and in one
   process (the same model unsharded, analytic cost model).
2. The simulator's decisions per iteration (the slowest pipeline rank's: budgets, plans, gates and
   fused-point schedules) on two Table II presets: median, mean, the slowest after the first
   iteration (warm) and the first (cold: its plans and schedules are new).

    python benchmarks/decision_time.py [--steps 8] [--iterations 100]   (a few minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from bagualu_plugin import load_recipe
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.demo.job import demo_rank
from bagualu_plugin.demo.model import demo_model, rank_batches
from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.planner import decider
from bagualu_plugin.planner.path import PathPlanner
from bagualu_plugin.report import table
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.runtime.ledger import Ledger
from bagualu_plugin.runtime.plan_runtime import PlanRuntime
from bagualu_plugin.runtime.provisioner import Provisioner
from bagualu_plugin.sim.run import simulate

PARTS = ("begin_forward", "plan", "gate costs", "runtime install", "Ledger check")


def _instrument() -> dict[str, list[float]]:
    """Wrap the timed methods and functions of this process; the seconds of each call made inside a
    `begin_forward` (profiling and pre-training make calls of their own) land in the lists."""
    seconds: dict[str, list[float]] = defaultdict(list)
    inside = [False]

    def timed(cls, name: str, part: str) -> None:
        inner = getattr(cls, name)
        outer = part == "begin_forward"

        def wrapper(*args, **kwargs):
            if not (outer or inside[0]):
                return inner(*args, **kwargs)
            start, inside[0] = time.perf_counter(), True
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[part].append(time.perf_counter() - start)
                inside[0] = inside[0] and not outer

        setattr(cls, name, wrapper)

    timed(Provisioner, "begin_forward", "begin_forward")
    timed(PathPlanner, "answer", "plan")
    timed(decider, "gate_costs", "gate costs")
    timed(PlanRuntime, "set_plan", "runtime install")
    timed(Ledger, "refresh_if_changed", "Ledger check")
    forward = PlanRuntime.forward

    @contextmanager
    def entered(self, *args, **kwargs):
        start, counted = time.perf_counter(), inside[0]
        with forward(self, *args, **kwargs) as ledger:
            if counted:
                seconds["runtime install"].append(time.perf_counter() - start)
            yield ledger

    PlanRuntime.forward = entered
    return seconds


def _row(where: str, seconds: dict[str, list[float]], forwards: int) -> list[str]:
    begin = seconds["begin_forward"]
    cells = [where, f"{forwards}", f"{1e3 * statistics.mean(begin):.3f}", f"{1e3 * statistics.median(begin):.3f}"]
    return cells + [f"{1e3 * sum(seconds.get(p, ())) / forwards:.3f}" for p in PARTS[1:]]


def _ep_rank(rank: int, size: int, steps: int) -> dict[str, list[float]]:
    seconds = _instrument()
    demo_rank(rank, size, load_recipe("demo"), steps, ["adaptive"])
    return dict(seconds)


def _one_process(steps: int) -> dict[str, list[float]]:
    recipe = load_recipe("demo")
    recipe = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"ep": 1, "ep_rank": 0, "dp": 1})})
    model = demo_model(recipe.model)
    prov = Provisioner(model, recipe, model_cost(model, recipe.hardware))
    prov.ledger.on_overrun = "record"  # one process holds every expert: what matters here is the time
    batches = rank_batches(recipe, 0)
    seconds = _instrument()
    gc.freeze()
    for _ in range(steps):
        run_iteration(model, batches, prov.stage.schedule, prov)
        model.zero_grad(set_to_none=True)
    gc.unfreeze()
    return dict(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training iterations of the demo's model (default 8)")
    parser.add_argument("--iterations", type=int, default=100, help="simulated iterations per preset (default 100)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    rows = []
    ranks = run_ranks(_ep_rank, 4, args.steps, timeout_s=900, threads=1)
    for rank, seconds in enumerate(ranks):
        rows.append(_row(f"4 EP ranks, rank {rank}", seconds, len(seconds["begin_forward"])))
    one = _one_process(args.steps)
    rows.append(_row("one process", one, len(one["begin_forward"])))
    print("the Provisioner's decisions per micro-batch (ms; begin_forward includes the rest)")
    print(table(["where", "forwards", "begin_forward mean", "median", "plan", "gate costs", "runtime install", "Ledger check"], rows))

    sims = []
    for preset in ("glm-423b-a30b", "glm-1041b-a35b-12288"):
        result = simulate(load_recipe(preset), args.iterations, preset=preset)
        sims.append([
            preset, f"{1e3 * result.decision_median_s:.2f}", f"{1e3 * result.decision_s:.2f}",
            f"{1e3 * result.decision_warm_max_s:.2f}", f"{1e3 * result.decision_first_s:.2f}",
        ])
    print(f"\nthe simulator's decisions per iteration (ms, slowest rank, {args.iterations} iterations; paper: < 10 ms)")
    print(table(["preset", "median", "mean", "warm max (after the first)", "first (cold)"], sims))


if __name__ == "__main__":
    main()
