"""nanotron's 1F1B pipeline engine with the Provisioner at each of its scheduling points (paper
§V-A, Algorithm 1 per pipeline rank).

`OneForwardOneBackwardPipelineEngine.train_batch_iter` runs pp - rank - 1 warmup forwards, then
one forward and one backward at a time, then the cooldown backwards; every compute step goes
through `forward(context, state, micro_batch, model)` and `backward(context, state,
grad_accumulator)`. The subclass wraps those two and nothing else, so nanotron's loss scaling,
its send/recv state and its schedule are untouched:

- before a forward: `begin_forward(mb, Forward(tokens, seq_len), phase, in_flight)`, with the micro-batch
  id nanotron is about to count (`state.nb_forwards`), its phase in nanotron's loop and the
  micro-batches whose activations await backward (`state.microbatches_activations_requiring_backward`);
  the Provisioner checks both against its own 1F1B schedule;
- after it: `end_forward(mb)`; after a backward: `end_backward(mb)`.

It stays an instance of nanotron's 1F1B engine, so nanotron's `serialize` still writes
`pp_engine: 1f1b` and a saved config reloads (with the stock engine: the launcher installs this
one when the `bagualu:` section is enabled).
"""

from __future__ import annotations

from .compat import import_pipeline

import_pipeline()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine  # noqa: E402
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer  # noqa: E402

from ...costmodel import Forward  # noqa: E402
from ...costmodel.pipeline import fused_points, one_f_one_b  # noqa: E402
from ...runtime.dual_batch import DualBatchExecutor, StagePieces  # noqa: E402
from ...runtime.provisioner import Provisioner  # noqa: E402


class BagualuPipelineEngine(OneForwardOneBackwardPipelineEngine):
    """1F1B whose micro-batches are budgeted and planned by `provisioner` (this pipeline rank's),
    each of `tokens` tokens in sequences of `seq_len`."""

    def __init__(self, provisioner: Provisioner, tokens: int, seq_len: int):
        super().__init__()
        self.provisioner, self.tokens, self.seq_len = provisioner, tokens, seq_len
        self._warmup = 0

    def train_batch_iter(self, model, pg, batch, nb_microbatches, grad_accumulator):
        self._warmup = min(pg.size() - pg.rank() - 1, nb_microbatches)  # nanotron's warmup forwards
        return super().train_batch_iter(model=model, pg=pg, batch=batch, nb_microbatches=nb_microbatches, grad_accumulator=grad_accumulator)

    def forward(self, context, state, micro_batch, model):
        mb = state.nb_forwards  # nanotron counts it inside super().forward
        in_flight = len(state.microbatches_activations_requiring_backward)
        phase = "warmup" if mb < self._warmup else "steady"
        self.provisioner.begin_forward(mb, Forward(self.tokens, self.seq_len), phase=phase, in_flight=in_flight)
        output = super().forward(context, state, micro_batch, model)
        self.provisioner.end_forward(mb)
        return output

    def backward(self, context, state, grad_accumulator):
        mb = state.nb_backwards
        super().backward(context, state, grad_accumulator)
        self.provisioner.end_backward(mb)


class DualBatchPipelineEngine(BagualuPipelineEngine):
    """nanotron's 1F1B order with each steady F_x B_y fused (`runtime.dual_batch`, paper §V-B):
    the stage runs as pieces through the executor, not through the `PipelineBlock`s, so its
    activations and gradients cross ranks with nanotron's `P2P` here, once per scheduling point:
    receive x's input and y's output gradient, run the point, send x's output and y's input
    gradient (each rank's point i waits only on points i - 1 upstream and i downstream: no
    cycle). Losses are divided by the micro-batch count, outputs are nanotron's (`{"loss"}` on
    the last rank, a `TensorPointer` elsewhere), and the gradients accumulate as with
    `BagualuPipelineEngine`, bit for bit. `on_forward()` runs before each forward (the launcher's
    routing spikes)."""

    def __init__(self, provisioner: Provisioner, tokens: int, seq_len: int, on_forward=None):
        super().__init__(provisioner, tokens, seq_len)
        self.on_forward = on_forward or (lambda: None)

    def train_batch_iter(self, model, pg, batch, nb_microbatches, grad_accumulator):
        if grad_accumulator is not None:
            raise ValueError("DualBatchPipelineEngine accumulates gradients in the parameters: pass grad_accumulator=None")
        pp, rank, p2p = pg.size(), dist.get_rank(pg), model.p2p
        first, last = rank == 0, rank == pp - 1
        executor = DualBatchExecutor.of(self.provisioner, lambda: StagePieces(model.causal_lm, pp, rank, loss_divisor=nb_microbatches))
        executor.start()
        batch, outputs, in_flight = list(batch), [], 0

        def received(mb: int) -> torch.Tensor:
            if first:
                return batch[mb]["input_ids"]
            (hidden,) = p2p.recv_tensors(num_tensors=1, from_rank=rank - 1)
            return hidden.requires_grad_()

        def forwarded(mb: int, out: torch.Tensor) -> None:
            outputs.append({"loss": out} if last else {"loss": TensorPointer(pp - 1)})
            if not last:
                p2p.send_tensors([out.detach()], to_rank=rank + 1)

        def gradient() -> torch.Tensor | None:
            return None if last else p2p.recv_tensors(num_tensors=1, from_rank=rank + 1)[0]

        def backwarded(grad: torch.Tensor | None) -> None:
            if not first:
                p2p.send_tensors([grad], to_rank=rank - 1)

        for step, backward in fused_points(one_f_one_b(pp, rank, nb_microbatches)):
            engine = {"phase": step.phase, "in_flight": in_flight}
            mb = step.micro_batch
            labels = batch[mb]["labels"] if last else None
            if backward is not None:
                value = received(mb)
                grad = gradient()
                self.on_forward()
                out, grad_in = executor.point(mb, value, labels, backward.micro_batch, grad, **engine)
                forwarded(mb, out)
                backwarded(grad_in)
            elif step.kind == "F":
                value = received(mb)
                self.on_forward()
                forwarded(mb, executor.forward(mb, value, labels, **engine))
                in_flight += 1
            else:
                backwarded(executor.backward(mb, gradient()))
                in_flight -= 1
        return outputs
