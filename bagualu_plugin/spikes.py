"""Routing-spike schedules for demos and benchmarks (paper §II-B: 97.1% of iterations stay below
1.2x expert-load imbalance, 2.9% spike up to 2.6x), from a recipe's `spikes` section.

Imbalance is a rank's local routed pairs over the balanced share. Under expert parallelism of
`ep` ranks, every rank moving a fraction f of its pairs routed elsewhere onto that rank's experts
(`adapters.gate.RoutingSkew`) gives it imbalance 1 + f (ep - 1).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .config import Spikes


def imbalance_schedule(
    spikes: Spikes, iterations: int, micro_batches: int, moe_layers: Sequence[int]
) -> list[list[dict[int, float]]]:
    """`schedule[it][mb][layer]`: the imbalance of every MoE layer of every micro-batch. Each
    iteration spikes with `spike_probability`: one micro-batch (from `micro_batches`, or any)
    then routes (normal_max, spike_max] x balanced on the chosen layers; everything else stays
    within [1, normal_max]. Deterministic for the seed."""
    if iterations < 1 or micro_batches < 1:
        raise ValueError(f"iterations and micro_batches must be >= 1, got {iterations} and {micro_batches}")
    rng = random.Random(spikes.seed)
    layers = list(moe_layers) if spikes.layers == "all" else list(spikes.layers)
    candidates = spikes.micro_batches if spikes.micro_batches is not None else range(micro_batches)
    schedule = []
    for _ in range(iterations):
        it = [{layer: rng.uniform(1.0, spikes.normal_max_imbalance) for layer in moe_layers} for _ in range(micro_batches)]
        if spikes.enabled and rng.random() < spikes.spike_probability:
            mb = rng.choice(list(candidates))
            for layer in layers:
                it[mb][layer] = rng.uniform(spikes.normal_max_imbalance, spikes.spike_max_imbalance)
        schedule.append(it)
    return schedule


def skew_fraction(imbalance: float, ep_size: int) -> float:
    """The `RoutingSkew` fraction that makes this rank's local pairs `imbalance` x balanced."""
    if ep_size < 2:
        raise ValueError(f"routing skew needs expert parallelism (ep_size >= 2), got {ep_size}")
    if not 1.0 <= imbalance <= ep_size:
        raise ValueError(f"imbalance must be in [1, ep_size={ep_size}], got {imbalance}")
    return (imbalance - 1.0) / (ep_size - 1)
