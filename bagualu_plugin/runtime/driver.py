"""The one 1F1B driver: one training iteration of a pipeline rank on one process, its forwards and
backwards in nanotron's order (`costmodel.pipeline.one_f_one_b`), so the warmup micro-batches'
activations really stay alive together, as on that rank of a real pipeline.

Every caller runs micro-batches through it: the tests, the demo's policies, `bgl.apply` users on
one process; nanotron's engine and the dual-batch executor follow the same shape (begin_forward
before a forward, end_forward after it, end_backward after a backward). What a caller needs per
step, such as a micro-batch's routing skew that must hold in its backward's recompute too, or a
memory timeline, comes in as `around`, a context entered around each step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from ..costmodel import Forward
from ..costmodel.pipeline import Step, fused_points
from .dual_batch import DualBatchExecutor, StagePieces
from .outputs import UNCOMPILED, compiled
from .provisioner import Provisioner


def run_iteration(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    schedule: Sequence[Step],
    provisioner: Provisioner | None = None,
    *,
    around: Callable[[Step], AbstractContextManager] | None = None,
) -> list[torch.Tensor]:
    """Run `schedule` (e.g. `Stage.schedule`) on `model`: a forward of micro-batch i computes the
    language-model loss of `batches[i]` (input ids, also the labels), its backward accumulates
    gradients; no optimizer step. `around(step)` is entered around each step (begin_forward and
    end_forward included). Returns every micro-batch's loss (detached), in micro-batch order.
    With the provisioner's recipe `pipeline.dual_batch` each steady forward and the backward after
    it run fused (`runtime.dual_batch`, paper §V-B), with the same results bit for bit.
    On an exception (an out-of-memory error among them) every graph still awaiting its backward
    is dropped with this call, and the provisioner abandons the iteration's micro-batches
    (`Provisioner.abandon`: nothing left installed or held, the error told what the Ledger
    counted), so the next iteration runs."""
    run = _fused if provisioner is not None and provisioner.recipe.pipeline.dual_batch else _plain
    try:
        return run(model, batches, schedule, provisioner, around)
    except BaseException as error:
        if provisioner is not None:
            provisioner.abandon(error)
        raise


def _plain(model, batches, schedule, provisioner, around) -> list[torch.Tensor]:
    """`run_iteration` one step after another."""
    awaiting: dict[int, torch.Tensor] = {}  # losses whose backward has not run yet
    losses: dict[int, torch.Tensor] = {}
    for step in schedule:
        mb, ids = step.micro_batch, batches[step.micro_batch]
        with around(step) if around else nullcontext():
            if step.kind == "F":
                if provisioner:
                    provisioner.begin_forward(mb, Forward(ids.numel(), ids.shape[-1]), phase=step.phase, in_flight=len(awaiting), ids=ids)
                output = model(input_ids=ids, labels=ids)  # one that raises is abandoned (run_iteration)
                if provisioner:
                    if compiled(output):
                        raise RuntimeError(UNCOMPILED)
                    provisioner.end_forward(mb)
                awaiting[mb] = output.loss
                del output
            else:
                loss = awaiting.pop(mb)
                loss.backward()
                losses[mb] = loss.detach()
                del loss
                if provisioner:
                    provisioner.end_backward(mb)
    if awaiting or len(losses) != len(batches):
        raise ValueError(f"the schedule left micro-batches {sorted(awaiting)} without a backward or ran {len(losses)} of {len(batches)}")
    return [losses[i] for i in range(len(batches))]


def _fused(model, batches, schedule, provisioner, around) -> list[torch.Tensor]:
    """`run_iteration` through the dual-batch executor: warmup forwards and cooldown backwards
    alone, each steady F_x B_y pair as one point."""
    steps = {(s.kind, s.micro_batch): s for s in schedule}
    executor = DualBatchExecutor.of(provisioner, lambda: StagePieces(model))
    executor.start((lambda kind, mb: around(steps[kind, mb])) if around else None)
    losses: dict[int, torch.Tensor] = {}
    in_flight: list[int] = []
    for step, backward in fused_points(schedule):
        ids = batches[step.micro_batch]
        engine = {"phase": step.phase, "in_flight": len(in_flight)} if provisioner else {}
        if backward is not None:
            losses[step.micro_batch], _ = executor.point(step.micro_batch, ids, ids, backward.micro_batch, **engine)
            in_flight.remove(backward.micro_batch)
            in_flight.append(step.micro_batch)
        elif step.kind == "F":
            losses[step.micro_batch] = executor.forward(step.micro_batch, ids, ids, **engine)
            in_flight.append(step.micro_batch)
        else:
            executor.backward(step.micro_batch)
            in_flight.remove(step.micro_batch)
    if in_flight or len(losses) != len(batches):
        raise ValueError(f"the schedule left micro-batches {sorted(in_flight)} without a backward or ran {len(losses)} of {len(batches)}")
    return [losses[i] for i in range(len(batches))]
