"""What a forward micro-batch is, as the cost model prices it (paper §IV-A: the load of every
operator follows from it): how many tokens it brings, how they split into sequences, how many
routed pairs each MoE layer gets, and the kind of forward it runs. One value travels from the
micro-batch's boundaries through the planner to the check after its forward, instead of the same
numbers passed one by one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

Routed = float | Sequence[float] | None


class ForwardKind(NamedTuple):
    """How a micro-batch's forward runs, where that changes what it keeps: its attention given a
    mask (SDPA then keeps it, and repeats keys and values under grouped-query attention), its
    head TRL's fused one (no logits), the token count its loss divides by, the routers'
    load-balancing loss, the dtype of the autocast it runs under ("bf16" or "fp16": linears,
    matmuls and attention then compute on copies in it of whatever operands are in another
    dtype, the weights' included, and keep those), whether it computes its loss (labels given;
    else the caller's loss runs on its logits after it). Each kind has its own cost model
    (`adapters.costs.model_cost`); `runtime.forward_kind` reads it off a forward's arguments."""

    masked: bool = False
    fused_head: bool = False
    loss_divisor_bytes: int = 0
    router_aux_loss: str = "none"
    autocast: str | None = None
    loss: bool = True

    def __str__(self) -> str:
        """The kind in words, for messages."""
        aux = {
            "all_tokens": "the routers' load-balancing loss",
            "attention_mask": "the routers' load-balancing loss over the attention mask",
        }
        parts = [
            "masked attention" * self.masked,
            "TRL's fused head" * self.fused_head,
            f"a loss divisor of {self.loss_divisor_bytes} bytes" if self.loss_divisor_bytes else "",
            aux.get(self.router_aux_loss, ""),
            f"{self.autocast} autocast" if self.autocast else "",
            "" if self.loss else "no labels",
        ]
        return ", ".join(part for part in parts if part) or "a plain forward"


@dataclass(frozen=True)
class Forward:
    """One forward micro-batch: `tokens` in all; `seq_len` tokens per sequence (None: one
    sequence, which only a model without per-sequence tensors allows); `routed`, the local routed
    pairs of its MoE layers (None: balanced routing, `tokens * pairs_per_token`; a number for
    every layer; one per MoE layer in order; or by layer, a mapping, kept in layer order); and
    its `kind`, which picks the cost model that prices it. Hashable: plans and predictions are
    remembered by it. The token count stays a field of its own: what is planned on forms of the
    shape (`planner.path`) takes it apart from the rest."""

    tokens: int
    seq_len: int | None = None
    routed: float | tuple[float, ...] | None = None
    kind: ForwardKind = ForwardKind()

    def __post_init__(self) -> None:
        if isinstance(self.routed, Mapping):
            object.__setattr__(self, "routed", tuple(pairs for _, pairs in sorted(self.routed.items())))
        elif self.routed is not None and not isinstance(self.routed, (int, float)):
            object.__setattr__(self, "routed", tuple(self.routed))

    def __str__(self) -> str:
        shape = f"{self.tokens} tokens" + ("" if self.seq_len is None else f" of length {self.seq_len}")
        return f"{shape} ({self.kind})"
