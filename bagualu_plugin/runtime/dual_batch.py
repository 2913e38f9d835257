"""The fused dual-batch executor (paper §V-B): at a steady 1F1B scheduling point F_x B_y of a
pipeline rank, the forward of x, the backward of y and the recovery (reloads, recompute) of y+1
run interleaved, piece by piece, in the order `planner.dual_batch` solves for the point.

A stage runs as pieces (`runtime.pieces`: the embedding, each decoder layer, the head), each an
autograd piece of its own: a piece's input is its predecessor's output detached, so the backward
of y can run piece by piece between the forward pieces of x (as Megatron-Core's ScheduleNode cuts
its combined 1F1B). Everything a micro-batch needs between pieces, its pieces' inputs and outputs
and its layers' shared inputs, lives in its `_Flight`, held here, never on a module: two
micro-batches are in flight at once.

The four classes map to the runtime's mechanisms:
- F: x's forward pieces, under x's plan (the Provisioner's begin_forward / end_forward around all
  of them);
- B: y's backward pieces, in reverse;
- O: x-1's offload copies. The plan's hooks issue each copy when its tensor is saved, on the copy
  stream on CUDA: the earliest point, so O is already in flight at every point and the executor
  issues nothing for it (the DP still counts its copy time on the copy stream);
- R: y+1's recovery of a block, its reloads (`SavedTensorHooks.prefetch`: the copies start, on
  the copy stream on CUDA) and then its recompute (`PlanRuntime.recover`: the block's regions
  replay now, ahead of y+1's backward, which takes their tensors). A region one rank chose alone runs no
  collective; one of the collective unit (under expert parallelism: a plan the same on every rank, or
  the gates' agreed escalation) replays its all-to-alls, which every rank reaches at the same piece,
  since every rank runs EP rank 0's order (`_agreed`).

R runs when y+1 is neither x nor x-1 (x - y > 2, §V-B); otherwise y+1 recovers lazily in its own
backward, as without fusion.

Under expert parallelism F's pieces hold all-to-alls (dispatch, combine), which the DP overlaps
with the other classes' compute of the same window. Each is issued, the window's next B or R
item runs while it is in flight (`parallel.expert.beside`), and only then is it waited on, on
every rank at the same exchange. A backward's own all-to-alls are waited on at once: a forward
piece run inside autograd's engine would be taken for a replay (`adapters.is_inside_backward`:
the gate decides nothing there, regions run plainly), and on CUDA it would run on autograd's
device thread. The results are bitwise those of the unfused schedule
(tests/test_dual_batch_executor.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..adapters import Adapter
from ..costmodel import Forward
from ..costmodel.pipeline import stage_layers
from ..costmodel.plan import Plan
from ..parallel.expert import Waits, beside
from ..planner.dual_batch import CLASSES, Schedule, ScheduleCache
from . import pieces
from .provisioner import Provisioner
from .telemetry import Event, Point

Around = Callable[[str, int], AbstractContextManager]  # (class "F" or "B", micro-batch) -> context


class StagePieces:
    """The pieces a pipeline rank runs of `model` (a supported HF causal LM): the embedding on the
    first rank, its decoder layers, the head (norm, LM head, loss) on the last. `blocks[k]` is
    piece k's block in the cost model (-1, a layer, `head_index`)."""

    def __init__(self, model: nn.Module, pp: int = 1, rank: int = 0, loss_divisor: int = 1):
        """`loss_divisor`: the head's loss is divided by it (nanotron divides each micro-batch's
        loss by the micro-batch count before its backward)."""
        self.adapter = a = Adapter(model)
        self.loss_divisor = loss_divisor
        self.layers = stage_layers(len(a.layers), pp, rank)
        self.first, self.last = rank == 0, rank == pp - 1
        self.blocks = [-1] * self.first + list(self.layers) + [a.head_index] * self.last

    def run(self, k: int, value: torch.Tensor, flight: _Flight) -> torch.Tensor:
        a, block = self.adapter, self.blocks[k]
        if block == -1:
            return pieces.embed(a, value)
        if block == a.head_index:
            loss = pieces.head(a, value, flight.labels)
            return loss / self.loss_divisor if self.loss_divisor != 1 else loss
        if flight.shared is None:  # made by the stage's first layer, shared by the others
            flight.shared = pieces.layer_inputs(a, value, self.layers)
        return pieces.decoder_layer(a, block, value, flight.shared)


@dataclass
class _Flight:
    """One micro-batch in flight on this rank: its pieces' detached inputs and their outputs, and
    with a Provisioner its event and the plan it runs (escalations included once its forward ended)."""

    labels: torch.Tensor | None
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    shared: pieces.LayerInputs | None = None
    event: Event | None = None
    plan: Plan | None = None


def _issue_order(schedule: Schedule) -> list[tuple[str, int, int]]:
    """(class, stage, window) as the executor issues them: window by window, a window's reloads
    (R's even stages) first, so that on CUDA they run on the copy stream under the window's
    compute, then the rest in F, B, O, R order (`Schedule.order`)."""
    order = []
    for w, window in enumerate(schedule.windows):
        run = [(CLASSES[c], s, w) for c, (a, b) in enumerate(window) for s in range(a, b)]
        order += sorted(run, key=lambda item: item[0] != "R" or item[1] % 2 == 1)
    return order


class DualBatchExecutor:
    """Runs a pipeline rank's forwards, backwards and fused steady points on `stage`, with
    `provisioner` (optional: without it a point runs in program order, F then B per block). It
    keeps the micro-batches in flight and the points' schedules (the DP's, cached block by
    block); the Provisioner budgets and plans each forward and never calls back. `overlap`: at a
    point, an all-to-all of x's forward waits only after the backward or recovery piece the
    schedule put beside it has run (False: it is waited on at once; the tally is kept either way)."""

    def __init__(self, stage: StagePieces, provisioner: Provisioner | None = None, overlap: bool = True):
        self.stage, self.provisioner, self.overlap = stage, provisioner, overlap
        self._flights: dict[int, _Flight] = {}
        self.start()
        self.schedules = ScheduleCache(provisioner.stage.chunks, provisioner.stage.options) if provisioner else None

    @classmethod
    def of(cls, provisioner: Provisioner, stage: Callable[[], StagePieces]) -> DualBatchExecutor:
        """The executor an engine runs `provisioner`'s stage through, made (from `stage()`) the first
        time: its schedules outlive an iteration, as the stage does."""
        overlap = provisioner.stage.recipe.pipeline.overlap_all_to_all is not False
        return provisioner.executor_of(lambda: cls(stage(), provisioner, overlap))

    def start(self, around: Around | None = None) -> None:
        """A new iteration: nothing in flight (one that raised leaves its graphs to the caller), and
        `around(kind, mb)` entered around each of its pieces."""
        self._flights.clear()
        self.around = around or (lambda kind, mb: nullcontext())

    # --- unfused: warmup forwards, cooldown backwards -------------------------------------------
    def forward(self, mb: int, value: torch.Tensor, labels: torch.Tensor | None = None, **engine) -> torch.Tensor:
        """Micro-batch `mb`'s forward through the stage: `value` is the input ids on the first rank,
        the received hidden states elsewhere; returns the loss on the last rank, else the hidden
        states to send. `engine`: `phase`, `in_flight` for `Provisioner.begin_forward`."""
        self._begin(mb, value, labels, **engine)
        for k in range(len(self.stage.blocks)):
            self._forward_piece(mb, k)
        return self._end_forward(mb)

    def backward(self, mb: int, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """Micro-batch `mb`'s backward: `grad` is the gradient of the stage's output (None on the
        last rank, whose output is the loss); returns the gradient of its input (None on the first)."""
        for k in reversed(range(len(self.stage.blocks))):
            self._backward_piece(mb, k, grad)
        return self._end_backward(mb)

    # --- fused: a steady point ----------------------------------------------------------------
    def point(
        self, x: int, value: torch.Tensor, labels: torch.Tensor | None, y: int, grad: torch.Tensor | None = None, **engine
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """F_x B_y fused (§V-B), with the recovery of y+1 when it is neither x nor x-1: returns x's
        output (as `forward`) and the gradient of y's input (as `backward`)."""
        if y not in self._flights:
            raise ValueError(f"point({x}, {y}): micro-batch {y} has no forward awaiting its backward")
        self._begin(x, value, labels, **engine)
        recovered = y + 1 if y + 1 < x - 1 and y + 1 in self._flights else None
        schedule, hit, solve_s = self._schedule(x, y, recovered)
        # the schedule's stages are the cost model's blocks (a later pipeline stage's block -1, the
        # RoPE tables it makes, runs inside its first layer's piece); pieces are the stage's
        blocks = list(self.provisioner.stage.cost.blocks) if self.provisioner else self.stage.blocks
        piece = {block: k for k, block in enumerate(self.stage.blocks)}
        last, out, ran, taken, waits = len(self.stage.blocks) - 1, None, [], [], Waits()

        def run(kind: str, s: int) -> None:
            nonlocal out
            ran.append(f"{kind}{s}")
            block = blocks[s] if kind in "FO" else blocks[len(blocks) - 1 - (s // 2 if kind == "R" else s)]
            if kind == "F" and block in piece:
                self._forward_piece(x, piece[block])
                if piece[block] == last:
                    out = self._end_forward(x)
            elif kind == "B" and block in piece:
                self._backward_piece(y, piece[block], grad)
            elif kind == "R" and recovered is not None:
                self._recover(recovered, block, reload=s % 2 == 0)

        queue = deque(self._agreed(_issue_order(schedule)))
        while queue:
            kind, s, window = queue.popleft()
            if kind != "F":
                run(kind, s)
                continue
            work = partial(self._beside_exchange, queue, window, "B" if recovered is None else "BR", run, taken) if self.overlap else None
            with beside(work, waits):
                run(kind, s)
        if out is None or y in self._flights and any(o is not None for o in self._flights[y].outputs):
            raise RuntimeError(f"point({x}, {y}): the schedule's blocks {blocks} do not cover the stage's pieces {self.stage.blocks}")
        flight = self._flights[x]
        grad_in = self._end_backward(y)
        if flight.event is not None:
            flight.event.point = Point(
                y, recovered, ran, schedule.time_s, schedule.serial_s, hit, solve_s, taken, waits.exchanges, waits.waited_s
            )
        return out, grad_in

    @staticmethod
    def _beside_exchange(queue: deque, window: int, kinds: str, run: Callable[[str, int], None], taken: list[str]) -> None:
        """While an all-to-all of x's forward piece is in flight: the next item of `kinds` (B, and R
        when a micro-batch is recovered; O issues nothing here) that the schedule put in the same
        window, taken out of the queue and run (`window_time` overlaps a class's all-to-alls with the
        others' compute). Every rank takes the same item at the same exchange: they run one order
        (`_agreed`) and issue the same all-to-alls."""
        for i, (kind, s, w) in enumerate(queue):
            if w != window:
                return
            if kind in kinds:
                del queue[i]
                run(kind, s)
                taken.append(f"{kind}{s}")
                return

    def _agreed(self, order: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """Under expert parallelism every rank of the group runs EP rank 0's order: F and B pieces
        hold all-to-alls that every rank must issue in the same order, and each rank's plans (so
        its solved order) follow its own routing."""
        group = self.stage.adapter.expert_group
        if group is None or group.size == 1:
            return order
        box, pg = [order], group.group or dist.group.WORLD
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        return box[0]

    def _schedule(self, x: int, y: int, recovered: int | None) -> tuple[Schedule, bool, float]:
        """The point's schedule: the DP's on the four micro-batches' plans (which the discretised
        budgets and the routing fix), cached block by block, else program order."""
        n = len(self.stage.blocks)
        if self.schedules is None:
            windows = tuple(((k, k + 1), (k, k + 1), (k, k), (2 * k, 2 * k)) for k in range(n))
            return Schedule(0.0, windows, 0.0), False, 0.0
        start, event = time.perf_counter(), self._flights[x].event
        plans = [self._flights[mb].plan if mb is not None and mb in self._flights else None for mb in (x, y, x - 1, recovered)]
        schedule, hit = self.schedules.get(event.tokens, event.seq_len, (0, 0, 0, 0), plans)  # chunk 0 each: plain 1F1B
        return schedule, hit, time.perf_counter() - start

    # --- pieces --------------------------------------------------------------------------------
    def _begin(self, mb: int, value: torch.Tensor, labels: torch.Tensor | None, **engine) -> None:
        if mb in self._flights:
            raise ValueError(f"forward of micro-batch {mb}: it is in flight already")
        if self.stage.last and labels is None:
            raise ValueError(f"forward of micro-batch {mb}: the last pipeline rank needs its labels")
        flight = _Flight(labels, inputs=[value], outputs=[None] * len(self.stage.blocks))
        if self.provisioner:
            shape = (value.numel(), value.shape[-1]) if self.stage.first else (value.shape[0] * value.shape[1], value.shape[1])
            with self.around("F", mb):
                flight.event = self.provisioner.begin_forward(mb, Forward(*shape), ids=value if self.stage.first else None, **engine)
            flight.plan = self.provisioner.runtime.plan
        self._flights[mb] = flight

    def _forward_piece(self, mb: int, k: int) -> None:
        flight = self._flights[mb]
        if k > 0:
            previous = flight.outputs[k - 1]
            flight.inputs.append(previous.detach().requires_grad_(previous.requires_grad))
        value = flight.inputs[k]
        with self.around("F", mb):
            flight.outputs[k] = self.stage.run(k, value, flight)

    def _end_forward(self, mb: int) -> torch.Tensor:
        flight = self._flights[mb]
        if self.provisioner:
            self.provisioner.end_forward(mb)
            flight.plan = self.provisioner.runtime.plan  # with the gates' escalations
        out = flight.outputs[-1]
        return out.detach().requires_grad_(out.requires_grad) if not self.stage.last else out.detach()

    def _backward_piece(self, mb: int, k: int, grad: torch.Tensor | None) -> None:
        flight = self._flights[mb]
        out, flight.outputs[k] = flight.outputs[k], None
        upstream = grad if k == len(self.stage.blocks) - 1 else flight.inputs[k + 1].grad
        if k + 1 < len(flight.inputs):
            flight.inputs[k + 1] = None
        if out.requires_grad:
            with self._as(mb), self.around("B", mb):
                torch.autograd.backward(out, upstream)

    def _end_backward(self, mb: int) -> torch.Tensor | None:
        flight = self._flights.pop(mb)
        first = flight.inputs[0]
        if self.provisioner:
            self.provisioner.end_backward(mb)
        return first.grad if isinstance(first, torch.Tensor) and first.requires_grad else None

    def _recover(self, mb: int, block: int, reload: bool) -> None:
        runtime = self.provisioner.runtime if self.provisioner else None
        if runtime is None:
            return
        with self._as(mb), self.around("B", mb):
            if reload:
                runtime.hooks.prefetch(mb, block)
            else:
                runtime.recover(mb, block)  # its copies are on their way: the regions replay

    @contextmanager
    def _as(self, mb: int) -> Iterator[None]:
        """Run backward or recovery work of micro-batch `mb` inside another's forward: the Ledger
        charges `mb` what it records, and the forward resumes with its micro-batch and op scope
        as it left them (the op scope decides how a save is kept)."""
        if self.provisioner is None:
            yield
            return
        runtime = self.provisioner.runtime
        current = runtime.tracker.current
        try:
            with runtime.micro_batches.charging(mb):
                yield
        finally:
            runtime.tracker.current = current
