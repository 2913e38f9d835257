"""The routing trace a simulation replays (paper §II-B): per iteration, per micro-batch, the
imbalance of every MoE layer on the busiest expert-parallel rank, from the recipe's `spikes`
section (`spikes.imbalance_schedule`: 97.1% of iterations under 1.2x, 2.9% spiking up to 2.6x),
or read from a JSONL file of real routing (`read_trace`: this project's telemetry records the
local routed pairs at every MoE gate). Every system of one run replays the same trace.

Imbalances are rounded up to `QUANTUM` (a routing bucket): costs are then looked up, not
recomputed, for repeated routings, and every system sees a slightly heavier routing than drawn.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..config import Recipe
from ..spikes import imbalance_schedule

QUANTUM = 1 / 32  # of the balanced routed pairs


@dataclass(frozen=True)
class Trace:
    """`imbalance[it][mb]`: the imbalance of each MoE layer of the whole model, in `layers` order."""

    layers: tuple[int, ...]
    imbalance: tuple[tuple[tuple[float, ...], ...], ...]

    @property
    def iterations(self) -> int:
        return len(self.imbalance)

    def positions(self, layers: list[int]) -> tuple[int, ...]:
        """Where `layers` (some of the model's MoE layers, e.g. one stage's) are in a row."""
        return tuple(self.layers.index(layer) for layer in layers)

    def of(self, it: int, mb: int, positions: tuple[int, ...]) -> tuple[float, ...]:
        """The imbalance of the layers at `positions` in micro-batch `mb` of iteration `it`."""
        row = self.imbalance[it][mb]
        return tuple(row[p] for p in positions)

    def peak(self, it: int) -> float:
        """The largest imbalance anywhere in iteration `it` (what an operator observes after a crash)."""
        return max(max(mb) for mb in self.imbalance[it])


def bucket(imbalance: float) -> float:
    """`imbalance` rounded up to a multiple of `QUANTUM` (a small tolerance absorbs float noise)."""
    return math.ceil(imbalance / QUANTUM - 1e-9) * QUANTUM


def routing_trace(recipe: Recipe, iterations: int, seed: int | None = None) -> Trace:
    """The seeded trace of `recipe.spikes` (spikes on even where the recipe leaves them off: the
    simulation is of §VI-C's spiky training), over all MoE layers of the model; `seed`
    overrides the recipe's."""
    m = recipe.model
    layers = tuple(range(m.first_k_dense, m.num_layers))
    update = {"enabled": True} if seed is None else {"enabled": True, "seed": seed}
    spikes = recipe.spikes.model_copy(update=update)
    schedule = imbalance_schedule(spikes, iterations, recipe.pipeline.micro_batches, layers)
    return Trace(layers, tuple(tuple(tuple(bucket(mb[layer]) for layer in layers) for mb in it) for it in schedule))


def read_trace(path: str | Path, recipe: Recipe, iterations: int) -> Trace:
    """A trace of recorded routing, for `iterations` iterations of `recipe`: a JSONL file with one
    forward micro-batch per line, as the Provisioner's telemetry writes them (`runtime.Event`):
    `micro_batch`, `routed` (MoE layer -> local routed pairs its gate saw) and `balanced_pairs`
    (what balanced routing brings a layer), so each layer's imbalance is routed / balanced. A
    micro-batch index that does not grow starts a new iteration. The recording may come from a
    smaller run than the recipe (a tiny model, fewer micro-batches, fewer iterations): its
    imbalances are tiled, the recipe's MoE layer j taking recorded layer j mod L, micro-batch mb
    recorded micro-batch mb mod M (of that iteration), iteration it recorded iteration it mod I."""
    recorded: list[list[tuple[float, ...]]] = []
    previous = None
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            mb, routed, balanced = int(event["micro_batch"]), event["routed"], float(event["balanced_pairs"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}, line {n}: expected a JSON object with micro_batch, routed and balanced_pairs ({exc})") from None
        if not routed or balanced <= 0:
            raise ValueError(f"{path}, line {n}: routed must name at least one MoE layer and balanced_pairs be > 0")
        if previous is None or mb <= previous:
            recorded.append([])
        previous = mb
        recorded[-1].append(tuple(routed[layer] / balanced for layer in sorted(routed, key=int)))
    if not recorded:
        raise ValueError(f"{path}: no micro-batches recorded")
    m = recipe.model
    layers = tuple(range(m.first_k_dense, m.num_layers))
    rows = []
    for it in range(iterations):
        run = recorded[it % len(recorded)]
        rows.append(tuple(
            tuple(bucket(run[mb % len(run)][j % len(run[mb % len(run)])]) for j in range(len(layers)))
            for mb in range(recipe.pipeline.micro_batches)
        ))
    return Trace(layers, tuple(rows))
