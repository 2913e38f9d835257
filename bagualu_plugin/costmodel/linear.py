"""Costs that are linear in the load of a micro-batch (paper §IV-A).

Every per-operator quantity of the cost model (forward time Δt_f, backward time Δt_b, saved
elements) is a `LinearForm` over three load variables:

- T, tokens of the micro-batch on this device (dense operators),
- S, routed (token, expert) pairs landing on this device's experts (expert operators),
- Q, attention score pairs, sum over sequences of L², i.e. T*L for sequences of length L
  (the quadratic term of eager attention),
- L, positions of one sequence (tables shared by the sequences of a batch, e.g. RoPE's cos/sin),
- N, sequences (per-sequence padding, e.g. the loss's shifted labels keep L + 1 per sequence),
- 1₁ and T₁: 1 and the tokens of a micro-batch that is a single sequence (else 0): some
  kernels keep a view for one sequence where several need a contiguous copy, so the saved
  storage is larger then (DeepSeek-V3's eager attention keeps its whole key/value projection,
  the loss keeps its padded labels).

The same form serves an analytic model built from dimensions and a model fitted to profiles.

Without a sequence length, a micro-batch of T tokens is read as one sequence of T tokens. That is
wrong in proportion to the batch for the terms a micro-batch keeps per sequence (`PER_SEQUENCE`):
Q (eager attention's probabilities, B times too many for B sequences), N, and T₁ (MLA's
single-sequence view of all T tokens); so a model with any of them needs the sequence length. The
other two terms are kept once per micro-batch: L (one table of positions: RoPE's cos/sin, the
position ids) and 1₁ (the one padded label row of a single sequence). Read at L = T they are high
by at most T - L table rows and one label row, however many sequences the batch holds.
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass


@dataclass(frozen=True)
class Load:
    """What one micro-batch puts on one MoE layer of one device."""

    tokens: float
    routed: float
    score_pairs: float
    positions: float
    sequences: float = 1.0
    single: float = 0.0
    single_tokens: float = 0.0

    @classmethod
    def of(cls, tokens: float, routed: float | None, seq_len: float | None, top_k: float) -> Load:
        """Sequences of `seq_len` tokens (None: one sequence of all tokens); routed None: T * top_k."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if routed is not None and routed < 0:
            raise ValueError(f"routed must be >= 0, got {routed}")
        if seq_len is not None and (seq_len <= 0 or tokens % seq_len):
            raise ValueError(f"seq_len must be a positive divisor of tokens ({tokens}), got {seq_len}")
        length = tokens if seq_len is None else seq_len
        single = 1.0 if length == tokens else 0.0
        sequences = tokens / length if length else 0
        routed = tokens * top_k if routed is None else routed
        return cls(tokens, routed, tokens * length, length, sequences, single, single * tokens)


@dataclass(frozen=True)
class LinearForm:
    """const + per_token * T + per_routed * S + per_score * Q + per_position * L
    + per_sequence * N + per_single * 1₁ + per_single_token * T₁."""

    const: float = 0.0
    per_token: float = 0.0
    per_routed: float = 0.0
    per_score: float = 0.0
    per_position: float = 0.0
    per_sequence: float = 0.0
    per_single: float = 0.0
    per_single_token: float = 0.0

    def at(self, load: Load) -> float:
        if type(load) is not Load:  # a load of forms (`symbolic.FormLoad`) makes the form itself
            return load.at(self)
        return (
            self.const
            + self.per_token * load.tokens
            + self.per_routed * load.routed
            + self.per_score * load.score_pairs
            + self.per_position * load.positions
            + self.per_sequence * load.sequences
            + self.per_single * load.single
            + self.per_single_token * load.single_tokens
        )

    def __add__(self, other: LinearForm) -> LinearForm:
        return LinearForm(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, k: float) -> LinearForm:
        return LinearForm(*(a * k for a in astuple(self)))

    __rmul__ = __mul__

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v}

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> LinearForm:
        return cls(**d)

    @property
    def per_sequence_terms(self) -> tuple[str, ...]:
        """The nonzero coefficients of terms kept per sequence (`PER_SEQUENCE`)."""
        return tuple(c for c in PER_SEQUENCE if getattr(self, c))


PER_SEQUENCE = ("per_score", "per_sequence", "per_single_token")
ZERO = LinearForm()
