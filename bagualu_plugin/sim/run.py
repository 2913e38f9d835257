"""`bagualu simulate`: every system of `systems` on the same seeded routing trace, on every pipeline
rank of a recipe (a Table II preset), iteration by iteration (paper §VI-B, §VI-C). Everything it
reports is simulated: the cost model's times on the preset's hardware, not measurements.

An iteration crashes when any rank's peak, its static bytes plus what the micro-batches in flight
hold at the end of a forward under 1F1B (`costmodel.iteration_curve`), exceeds its capacity. A
crash costs a cold restart of `spikes.restart_iterations` of the system's mean iterations (284 s
~ 16 iterations, §II-B); the system may then change its plan (`System.after_crash`) and the
iteration runs again; if nothing would change, its tokens are lost. Throughput counts every
second, restarts included, as §VI-A does.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ..collector import frozen
from ..config import Recipe
from ..costmodel import MicroBatchCost, iteration_curve
from ..costmodel.dims import ModelDims, param_count
from .costs import MicroBatch
from .pipeline import iteration_time, p2p_seconds
from .systems import Rank, System, ablation, systems
from .trace import Trace, routing_trace


@dataclass(frozen=True)
class Outcome:
    """One system's simulated run."""

    system: str
    mfu: float  # fraction of peak, `mfu`
    tokens_per_s: float
    ooms: int
    speedup_vs_best_baseline: float  # tokens/s over the fastest system other than bagualu
    iteration_s: float  # mean of the iterations that ran through
    lost_iterations: int  # crashed with no plan left to change: their tokens are not counted
    iteration_mfu: list[float]  # per iteration, its restarts included (Fig. 9)


@dataclass(frozen=True)
class Level:
    """One step of the ablation (Fig. 11)."""

    level: str
    tokens_per_s: float
    ooms: int
    speedup_vs_previous: float


@dataclass(frozen=True)
class Simulation:
    preset: str
    iterations: int
    seed: int
    outcomes: list[Outcome]
    ablation: list[Level]
    decision_s: float  # BaGuaLu's decisions per iteration, the slowest rank's, mean over the run
    decision_median_s: float  # its median: an iteration once the plan and schedule caches are warm
    decision_max_s: float
    decision_warm_max_s: float  # the slowest iteration after the first, whose caches start cold
    decision_first_s: float
    decision_forward_s: list[float]  # per chunk forward in order, the slowest rank's budget, plan and gates (the first starts cold)

    def to_json(self) -> dict:
        forwards = sorted(self.decision_forward_s[1:]) or self.decision_forward_s
        return {"preset": self.preset, "simulated": True, "iterations": self.iterations, "seed": self.seed,
                "systems": [asdict(o) for o in self.outcomes], "ablation": [asdict(a) for a in self.ablation],
                "decision_s_per_iteration": self.decision_s, "decision_median_s_per_iteration": self.decision_median_s,
                "decision_max_s_per_iteration": self.decision_max_s, "decision_warm_max_s_per_iteration": self.decision_warm_max_s,
                "decision_first_s_per_iteration": self.decision_first_s,
                "decision_median_s_per_forward": statistics.median(self.decision_forward_s),
                "decision_p99_s_per_forward": forwards[math.ceil(0.99 * len(forwards)) - 1],
                "decision_warm_max_s_per_forward": forwards[-1], "decision_first_s_per_forward": self.decision_forward_s[0]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def model_flops_per_token(dims: ModelDims, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward and backward), as MFU counts them (PaLM,
    appendix B; Megatron-LM): 6 per active parameter that multiplies it (every parameter a token
    routes through, the input embedding excluded, the LM head included), plus the attention
    matmuls, 12 x layers x heads x head dim x sequence length (QK^T and the context, forward
    and backward, the causal mask not discounted). Recompute and mitigation are not model FLOPs."""
    active = param_count(dims, active=True) - dims.vocab_size * dims.hidden_size
    return 6 * active + 12 * dims.num_layers * dims.num_attention_heads * dims.head_dim * seq_len


def mfu(recipe: Recipe, tokens_per_s: float) -> float:
    """Model FLOP/s over the cluster's peak: model_flops_per_token x tokens/s / (devices x peak FLOP/s)."""
    flops = model_flops_per_token(recipe.model, recipe.batch.seq_len) * tokens_per_s
    return flops / (recipe.gpus * recipe.hardware.peak_flops)


def fits(ranks: list[Rank], micro_batches: list[list[MicroBatch]]) -> bool:
    """Whether every rank's 1F1B peak stays within its capacity."""
    pp = len(ranks)
    for r, (rank, mbs) in enumerate(zip(ranks, micro_batches)):
        costs = [MicroBatchCost(mb.forward_s, mb.backward_s, mb.held_bytes) for mb in mbs]
        if iteration_curve(costs, pp, r, rank.stage.static_bytes, len(rank.costs)).peak_bytes > rank.stage.capacity:
            return False
    return True


def _run(system: System, ranks: list[Rank], trace: Trace, p2p_s: float) -> list[tuple[float | None, int]]:
    """Per iteration of the trace: its time (None: lost, it crashed with no plan left to change)
    and the crashes it cost first."""
    timeline = []
    for it in range(trace.iterations):
        crashes = 0
        while True:
            mbs = system.iteration(it)
            if fits(ranks, mbs):
                forward, backward = ([[getattr(m, f) for m in r] for r in mbs] for f in ("forward_s", "backward_s"))
                t = iteration_time(forward, backward, p2p_s, len(ranks[0].costs))
                timeline.append((t, crashes))
                break
            crashes += 1
            if not system.after_crash(trace.peak(it)):
                timeline.append((None, crashes))
                break
    return timeline


def simulate(recipe: Recipe, iterations: int = 100, seed: int | None = None, preset: str = "", trace: Trace | None = None) -> Simulation:
    """Every system of `systems.SYSTEMS` over `iterations` of the recipe's seeded spike trace, or
    of `trace` (e.g. `read_trace`'s recorded routing)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if trace is not None and trace.iterations != iterations:
        raise ValueError(f"trace has {trace.iterations} iterations, iterations is {iterations}")
    trace = trace or routing_trace(recipe, iterations, seed)
    every = systems(recipe, trace)
    ranks = every[0].ranks
    p2p_s = p2p_seconds(recipe)
    tokens = recipe.parallel.dp * recipe.pipeline.micro_batches * recipe.batch.tokens  # per iteration, all replicas
    restart = recipe.spikes.restart_iterations

    def run(system: System) -> tuple[str, float, int, float, int, list[float]]:
        """Its tokens/s over the run (a crash costs `restart` mean iterations), crashes, mean
        iteration, lost iterations, and each iteration's MFU with the restarts it paid (Fig. 9)."""
        timeline = _run(system, ranks, trace, p2p_s)
        times = [t for t, _ in timeline if t is not None]
        crashes = sum(c for _, c in timeline)
        mean = sum(times) / len(times) if times else float("inf")
        elapsed = sum(times) + crashes * restart * mean
        each = [mfu(recipe, tokens / (t + c * restart * mean)) if t is not None else 0.0 for t, c in timeline]
        lost = sum(t is None for t, _ in timeline)
        return system.name, len(times) * tokens / elapsed if times else 0.0, crashes, mean, lost, each

    levels, previous = [], None
    with frozen():  # the systems' prepared plans live to the end: no full collection inside a timed decision
        rows = [run(system) for system in every]
        for name, rate, crashes, *_ in (run(system) for system in ablation(recipe, trace, ranks)):
            levels.append(Level(name, rate, crashes, rate / previous if previous else 1.0))
            previous = rate
    best = max(rate for name, rate, *_ in rows if name != "bagualu")
    outcomes = [
        Outcome(name, mfu(recipe, rate), rate, crashes, rate / best if best else float("inf"), mean, lost, each)
        for name, rate, crashes, mean, lost, each in rows
    ]
    decisions = every[0].decision_s  # bagualu's
    seed = recipe.spikes.seed if seed is None else seed
    return Simulation(
        preset, iterations, seed, outcomes, levels, statistics.mean(decisions), statistics.median(decisions), max(decisions),
        max(decisions[1:], default=decisions[0]), decisions[0], every[0].decision_forward_s,
    )
