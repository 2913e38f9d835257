"""nanotron's 1F1B pipeline engine with the Provisioner at each of its scheduling points (paper
§V-A, Algorithm 1 per pipeline rank).

`OneForwardOneBackwardPipelineEngine.train_batch_iter` runs pp - rank - 1 warmup forwards, then
one forward and one backward at a time, then the cooldown backwards; every compute step goes
through `forward(context, state, micro_batch, model)` and `backward(context, state,
grad_accumulator)`. The subclass wraps those two and nothing else, so nanotron's loss scaling,
its send/recv state and its schedule are untouched:

- before a forward: `begin_forward(mb, tokens, seq_len, phase, in_flight)`, with the micro-batch
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

from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine  # noqa: E402

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
        self.provisioner.begin_forward(mb, self.tokens, self.seq_len, phase=phase, in_flight=in_flight)
        output = super().forward(context, state, micro_batch, model)
        self.provisioner.end_forward(mb)
        return output

    def backward(self, context, state, grad_accumulator):
        mb = state.nb_backwards
        super().backward(context, state, grad_accumulator)
        self.provisioner.end_backward(mb)
