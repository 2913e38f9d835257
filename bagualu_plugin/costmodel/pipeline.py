"""The activation memory curve of one pipeline stage over an iteration (paper §IV-A, Fig. 5c).

A forward micro-batch is a rising triangle (Δm over Δt_f), a backward a falling one. Rank r of a
P-stage 1F1B pipeline runs, as nanotron's `OneForwardOneBackwardPipelineEngine` does,
min(P - r - 1, m) warmup forwards, then forward/backward pairs (steady), then the remaining
backwards (cooldown). Memory only rises during forwards, so the peak is reached at the end of one.

The paper trains with Megatron-LM's interleaved 1F1B (§VI-A): each rank holds `vp` model chunks
(virtual stages) and every forward or backward is one chunk of one micro-batch.
`interleaved_one_f_one_b` gives that order, `warmup_depth` the chunk forwards that stack. Table
II's VP column counts layers per virtual stage, so there vp = num_layers / (pp * VP).
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
    chunk: int = 0  # the model chunk (virtual stage) it runs; always 0 without interleaving


def stage_layers(num_layers: int, pp: int, rank: int, vp: int = 1, chunk: int = 0) -> range:
    """The decoder layers (positions among them) that rank `rank` of a `pp`-stage pipeline holds:
    an equal share, in order. With `vp` chunks per rank, chunk `chunk` holds virtual stage
    chunk * pp + rank of pp * vp equal ones, so a micro-batch visits every rank once per chunk."""
    if pp < 1 or not 0 <= rank < pp:
        raise ValueError(f"need 0 <= rank < pp, got rank={rank}, pp={pp}")
    if vp < 1 or not 0 <= chunk < vp:
        raise ValueError(f"need vp >= 1 and 0 <= chunk < vp, got chunk={chunk}, vp={vp}")
    stages = pp * vp
    if num_layers % stages:
        split = f"pp={pp} stages" if vp == 1 else f"pp*vp={stages} virtual stages (pp={pp}, vp={vp})"
        raise ValueError(f"{num_layers} decoder layers do not split evenly over {split}")
    per = num_layers // stages
    first = (chunk * pp + rank) * per
    return range(first, first + per)


def fused_points(schedule: Sequence[Step]) -> list[tuple[Step, Step | None]]:
    """`schedule` as the dual-batch executor runs it (§V-B): a forward followed by another
    micro-batch's backward is one scheduling point (F, B); every other step runs alone (step, None)."""
    out, i = [], 0
    while i < len(schedule):
        step, following = schedule[i], schedule[i + 1] if i + 1 < len(schedule) else None
        if step.kind == "F" and following is not None and following.kind == "B" and following.micro_batch != step.micro_batch:
            out.append((step, following))
            i += 2
        else:
            out.append((step, None))
            i += 1
    return out


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


def _check_interleaving(pp: int, rank: int, micro_batches: int, vp: int) -> None:
    if vp < 1:
        raise ValueError(f"vp must be >= 1, got {vp}")
    if pp < 1 or not 0 <= rank < pp:
        raise ValueError(f"need 0 <= rank < pp, got rank={rank}, pp={pp}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if vp > 1 and pp < 2:
        raise ValueError(f"vp={vp} interleaves chunks over pipeline ranks: it needs pp >= 2, got pp={pp}")
    if vp > 1 and micro_batches % pp:
        raise ValueError(f"with vp={vp} micro_batches must be a multiple of pp={pp} (they run in groups of pp), got {micro_batches}")


def _interleaved_warmup_forwards(pp: int, rank: int, micro_batches: int, vp: int) -> int:
    """Megatron-LM's warmup: every rank runs (vp - 1) groups of pp chunk forwards, an earlier rank
    two more per later rank (one to fill the pipeline, one for the backward coming back to it)."""
    return min((pp - rank - 1) * 2 + (vp - 1) * pp, micro_batches * vp)


def warmup_depth(pp: int, rank: int, micro_batches: int, vp: int = 1) -> int:
    """B_w of Algorithm 1 (§V-A): the forwards whose activations stack before the first backward
    on `rank`. The first steady forward also runs before any backward, so this is one more than
    the warmup forwards: min(pp - rank, m) for plain 1F1B. With vp > 1 it counts chunk forwards,
    each holding 1/vp of the rank's layers, so a per-micro-batch budget (and M0) would be one
    chunk's forward."""
    _check_interleaving(pp, rank, micro_batches, vp)
    if vp == 1:
        return min(pp - rank, micro_batches)
    return min(_interleaved_warmup_forwards(pp, rank, micro_batches, vp) + 1, micro_batches * vp)


def interleaved_one_f_one_b(pp: int, rank: int, micro_batches: int, vp: int) -> list[Step]:
    """The order of chunk forwards and backwards on `rank` of Megatron-LM's interleaved 1F1B with
    `vp` chunks per rank (§VI-A). Micro-batches go in groups of pp: the group runs
    chunk 0, then chunk 1, ...; backwards take the same micro-batches with the chunks reversed,
    the last chunk first. vp = 1 is plain 1F1B (`one_f_one_b`), whose warmup is pp - rank - 1,
    not the 2 * (pp - rank - 1) the interleaved rule would give."""
    _check_interleaving(pp, rank, micro_batches, vp)
    if vp == 1:
        return one_f_one_b(pp, rank, micro_batches)
    total = micro_batches * vp
    warmup = _interleaved_warmup_forwards(pp, rank, micro_batches, vp)

    def order(k: int) -> tuple[int, int]:  # the k-th chunk forward's (micro-batch, chunk)
        group, within = divmod(k, pp * vp)
        return group * pp + within % pp, within // pp

    def forward(k: int, phase: Phase) -> Step:
        mb, chunk = order(k)
        return Step("F", mb, phase, chunk)

    def backward(k: int, phase: Phase) -> Step:
        mb, chunk = order(k)
        return Step("B", mb, phase, vp - 1 - chunk)

    steps = [forward(k, "warmup") for k in range(warmup)]
    for k in range(total - warmup):
        steps += [forward(warmup + k, "steady"), backward(k, "steady")]
    steps += [backward(k, "cooldown") for k in range(total - warmup, total)]
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


def release_order(schedule: Sequence[Step]) -> tuple[int, ...]:
    """Algorithm 1's release order (§V-A) of a 1F1B-family `schedule`: for each forward after the
    first backward, the forward (its position among the schedule's forwards) whose activations
    the one backward run since the previous forward released. Plain 1F1B frees forward
    k - B_w before forward k; interleaved 1F1B frees the chunk its backward order reaches."""
    position = {(s.micro_batch, s.chunk): k for k, s in enumerate(x for x in schedule if x.kind == "F")}
    out, pending, started = [], [], False
    for step in schedule:
        if step.kind == "B":
            pending.append(position[(step.micro_batch, step.chunk)])
            started = True
        elif started:
            if len(pending) != 1:
                raise ValueError(f"forward {step} follows {len(pending)} backwards: not a 1F1B steady phase")
            out.append(pending.pop())
    return tuple(out)


def iteration_curve(costs: Sequence[MicroBatchCost], pp: int, rank: int, base_bytes: float = 0.0, vp: int = 1) -> Curve:
    """Memory of one stage through an iteration; `costs[mb * vp + chunk]` is micro-batch mb's
    triangle on this stage's chunk (micro-batches may differ, e.g. in routed pairs; vp = 1: one
    chunk, `costs[mb]`); `base_bytes` the non-activation bytes."""
    if vp < 1 or len(costs) % vp:
        raise ValueError(f"need one cost per micro-batch and chunk: {len(costs)} costs for vp={vp}")
    steps = interleaved_one_f_one_b(pp, rank, len(costs) // vp, vp)
    t, m = 0.0, float(base_bytes)
    times, levels = [t], [m]
    peak = (m, t, steps[0], 0)
    alive = 0
    for step in steps:
        c = costs[step.micro_batch * vp + step.chunk]
        if step.kind == "F":
            t, m, alive = t + c.forward_s, m + c.activation_bytes, alive + 1
            if m > peak[0]:
                peak = (m, t, step, alive)
        else:
            t, m, alive = t + c.backward_s, m - c.activation_bytes, alive - 1
        times.append(t)
        levels.append(m)
    return Curve(times, levels, steps, *peak)
