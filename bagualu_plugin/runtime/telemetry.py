"""A Provisioner's telemetry: what each micro-batch did (`Event`, and `Point` for a fused
scheduling point), the latest `EVENTS_KEPT` of them in memory, each written to the run's file as a
JSON line once complete (its backward has run), and the `bagualu/*` figures for a logger over the
micro-batches since the last call."""

from __future__ import annotations

import json
import warnings
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from ..config import Recipe
from ..planner.decider import Deferral, Escalation
from .calibration import Miss

EVENTS_KEPT = 4096  # events held in memory; the telemetry file has them all


@dataclass(frozen=True)
class Point:
    """A fused steady scheduling point F_x B_y as it ran (paper §V-B, `runtime.dual_batch`): y, the
    micro-batch recovered ahead (None: none), the (class, stage) items in the order they ran (one
    run beside an all-to-all of x's forward comes before that forward piece ends), the DP's
    predicted time and the classes' serial time, whether every block's schedule came from the
    cache, the seconds finding it took, the items run beside an all-to-all of x's forward, and
    those all-to-alls: how many, and the seconds x waited on them once the work beside them had run."""

    backward: int
    recovered: int | None
    order: list[str]
    predicted_s: float
    serial_s: float
    cache_hit: bool
    solve_s: float
    beside: list[str]
    exchanges: int
    waited_s: float


@dataclass
class Event:
    """One forward micro-batch, as the telemetry file has it (one JSON object per line, these
    fields in this order). Complete once its backward has run."""

    micro_batch: int
    phase: str
    budget: int
    predicted: float
    plan: dict[str, str]
    escalations: list[Escalation]
    deferred: list[Deferral]
    tokens: int
    seq_len: int
    room_bytes: float = 0.0  # room beyond what it keeps, counted in its budget: its backward's reloads, or a moment's saves (Footprint)
    planner_s: float = 0.0  # its budget, plan and their install (begin_forward past its model checks), and each gate's decision
    capacity: int = 0  # the stage's device capacity
    forward: int = 0  # its place among the run's forwards (the file is in backward order)
    mitigation_s: float = 0.0  # the time its plan adds, forward and backward, as the cost model prices it
    mitigated: dict[str, float] = field(default_factory=dict)  # device bytes its plan took off, per strategy (`CostModel.mitigated`)
    actual: int | None = None  # set by end_forward
    peak_device_bytes: int | None = None  # the run's peak so far (`Provisioner.peak_device_bytes`), at end_forward
    device_bytes: int | None = None  # static bytes and every micro-batch's activations, at its forward's end
    live_after_backward: int | None = None  # set by end_backward
    point: Point | None = None  # the fused scheduling point it began (runtime.dual_batch), if any
    routed: dict[int, int] = field(default_factory=dict)  # local routed pairs at each MoE layer's gate
    balanced_pairs: float = 0.0  # what balanced routing brings each MoE layer: `routed` / this is its imbalance
    kind: dict = field(default_factory=dict)  # how its forward ran (`costmodel.ForwardKind`)
    misses: list[Miss] = field(default_factory=list)  # ops that kept other bytes than predicted (`runtime.calibration`)
    ids_view_bytes: int = 0  # what its token ids keep beyond themselves: the larger tensor they are a view of (planned for)
    varlen_bytes: int = 0  # flash-attention's varlen arguments its layers receive (TRL's packing; planned for)
    spilled_bytes: int = 0  # kept activations its forward's saves moved to host memory, going past the capacity (`Ledger.spill_at`)

    def to_json(self) -> str:
        return json.dumps(vars(self), default=asdict)  # the nested dataclasses only made dicts (asdict copies all)


class EventLog:
    """The events of one Provisioner: `events`, the latest `EVENTS_KEPT` (a long run would
    otherwise grow without bound), each ended forward's, abandoned ones dropped; the telemetry
    file, open for the log's life (`recipe.telemetry`); and which of them `figures()` counted."""

    def __init__(self, recipe: Recipe):
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self._reported: Event | None = None  # the latest event the last `figures()` counted
        self.file = _telemetry_file(recipe)
        if self.file is not None:
            weakref.finalize(self, self.file.close)

    def ended(self, event: Event) -> None:
        """A micro-batch's forward ended: its event is the latest."""
        self.events.append(event)

    def drop(self, events: Iterable[Event]) -> None:
        """Abandoned micro-batches: their events go (from the figures too)."""
        dropped, kept, reported = set(map(id, events)), [], None
        for e in self.events:
            if id(e) not in dropped:
                kept.append(e)
            if e is self._reported:  # the latest event reported is the latest kept up to it
                reported = kept[-1] if kept else None
        self.events.clear()
        self.events.extend(kept)
        if self._reported is not None and id(self._reported) in dropped:
            self._reported = reported

    def complete(self, event: Event) -> None:
        """Its backward has run: the event, complete, goes to the file."""
        if self.file is None:
            return
        try:
            self.file.write(event.to_json() + "\n")
        except OSError as exc:  # a full disk ends the file, not the training
            _telemetry_lost(Path(self.file.name), exc)
            self.close()

    def figures(self, peak_device_bytes: int, capacity: int) -> dict[str, float]:
        """The peak device bytes so far (static memory plus the Ledger's activations) against the
        capacity; over the micro-batches since the last call the tightest budget, the most mitigated
        ops in one plan, the bytes the plans took off, the gates' escalations and deferrals, planner
        ms per micro-batch, the ops that kept other bytes than the cost model predicted
        (`runtime.calibration`) and the bytes spilled to the host."""
        events = list(self.events)
        start = next((i + 1 for i in range(len(events) - 1, -1, -1) if events[i] is self._reported), 0)  # gone: all are new
        new, self._reported = events[start:], events[-1] if events else None
        figures = {"bagualu/peak_device_bytes": peak_device_bytes, "bagualu/capacity_bytes": capacity, "bagualu/micro_batches": len(new)}
        if new:
            figures.update({
                "bagualu/budget_bytes": min(e.budget for e in new),
                "bagualu/mitigated_ops": max(len(e.plan) for e in new),
                "bagualu/mitigated_bytes": max(sum(e.mitigated.values()) for e in new),
                "bagualu/escalations": sum(len(e.escalations) for e in new),
                "bagualu/deferrals": sum(len(e.deferred) for e in new),
                "bagualu/planner_ms": 1e3 * sum(e.planner_s for e in new) / len(new),
                "bagualu/cost_model_misses": sum(len(e.misses) for e in new),
                "bagualu/spilled_bytes": sum(e.spilled_bytes for e in new),
            })
        return figures

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _telemetry_file(recipe: Recipe) -> TextIO | None:
    """This process's events file (`Telemetry.file`: one per rank where several run), begun
    anew (a run's file holds that run's micro-batches only) and kept open, line-buffered: each
    event is on disk as it is written, a crash loses none, and no micro-batch pays for opening
    the file. One that cannot be written (a read-only working directory) is said, and the run
    goes on without it."""
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    path = recipe.telemetry.file(rank, world)
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("w", buffering=1)
    except OSError as exc:
        _telemetry_lost(path, exc)
        return None


def _telemetry_lost(path: Path, exc: OSError) -> None:
    warnings.warn(
        f"bagualu: cannot write the telemetry to {path} ({exc.strerror or exc}): this run's events stay in memory only "
        "(Provisioner.events); give the recipe a writable telemetry.path, or telemetry.enabled: false",
        RuntimeWarning, stacklevel=3,
    )
