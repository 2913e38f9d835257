"""The activation memory curve of one pipeline stage over an iteration (paper §IV-A, Fig. 5c).

A forward micro-batch is a rising triangle (Δm over Δt_f), a backward a falling one. Rank r of a
P-stage 1F1B pipeline runs, as nanotron's `OneForwardOneBackwardPipelineEngine` does,
min(P - r - 1, m) warmup forwards, then forward/backward pairs (steady), then the remaining
backwards (cooldown). Memory only rises during forwards, so the peak is reached at the end of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Phase = Literal["warmup", "steady", "cooldown"]


@dataclass(frozen=True)
class MicroBatchCost:
    """The paper's micro-batch triangle: ΣΔt_f wide going up, ΣΔt_b wide coming down, ΣΔm high."""

    forward_s: float
    backward_s: float
    activation_bytes: float


@dataclass(frozen=True)
class Step:
    kind: Literal["F", "B"]
    micro_batch: int
    phase: Phase


def stage_layers(num_layers: int, pp: int, rank: int) -> range:
    """The decoder layers (positions among them) that rank `rank` of a `pp`-stage pipeline holds:
    an equal share, in order."""
    if pp < 1 or not 0 <= rank < pp:
        raise ValueError(f"need 0 <= rank < pp, got rank={rank}, pp={pp}")
    if num_layers % pp:
        raise ValueError(f"{num_layers} decoder layers do not split evenly over pp={pp} stages")
    per = num_layers // pp
    return range(rank * per, (rank + 1) * per)


def one_f_one_b(pp: int, rank: int, micro_batches: int) -> list[Step]:
    """The order of forwards and backwards on `rank` of a `pp`-stage 1F1B pipeline."""
    if pp < 1 or not 0 <= rank < pp:
        raise ValueError(f"need 0 <= rank < pp, got rank={rank}, pp={pp}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    warmup = min(pp - rank - 1, micro_batches)
    steps = [Step("F", i, "warmup") for i in range(warmup)]
    for i in range(micro_batches - warmup):
        steps += [Step("F", warmup + i, "steady"), Step("B", i, "steady")]
    steps += [Step("B", i, "cooldown") for i in range(micro_batches - warmup, micro_batches)]
    return steps


@dataclass(frozen=True)
class Curve:
    """Piecewise-linear memory over time: the point (times[i], bytes[i]) ends steps[i - 1]."""

    times: list[float]
    bytes: list[float]
    steps: list[Step]
    peak_bytes: float
    peak_time: float
    peak_step: Step  # the forward at whose end the peak is reached
    in_flight_at_peak: int  # micro-batches whose activations are alive at the peak


def iteration_curve(costs: Sequence[MicroBatchCost], pp: int, rank: int, base_bytes: float = 0.0) -> Curve:
    """Memory of one stage through an iteration; `costs[i]` is micro-batch i's triangle on this
    stage (micro-batches may differ, e.g. in routed pairs); `base_bytes` the non-activation bytes."""
    steps = one_f_one_b(pp, rank, len(costs))
    t, m = 0.0, float(base_bytes)
    times, levels = [t], [m]
    peak = (m, t, steps[0], 0)
    alive = 0
    for step in steps:
        c = costs[step.micro_batch]
        if step.kind == "F":
            t, m, alive = t + c.forward_s, m + c.activation_bytes, alive + 1
            if m > peak[0]:
                peak = (m, t, step, alive)
        else:
            t, m, alive = t + c.backward_s, m - c.activation_bytes, alive - 1
        times.append(t)
        levels.append(m)
    return Curve(times, levels, steps, *peak)
