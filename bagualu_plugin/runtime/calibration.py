"""The cost model checked against the Ledger while training (paper §IV's per-operator model, kept
true at run time). The analytic models describe, per family, what each op saves in the
transformers releases the project tests; a release that saves one more tensor in some op (or one
fewer) shows here first, not as an out-of-memory error.

- After each forward, the bytes the Ledger charged to each op are compared with what the kind's
  cost model predicts for the plan in force and the routing its gates saw
  (`CostModel.device_bytes_by_op`, which charges as the Ledger charges). A difference either way
  is reported once per (kind of forward, op), naming the family, the kind, the versions, both
  byte counts and the likely cause (a release outside the tested range, else the cost model of
  that kind), and goes into the micro-batch's telemetry (`Event.misses`).
- A kind whose forwards miss `UNCONVERGED` times in a row, planning on the measured bytes
  included, is a failure of the cost model the check reports once: its plans may be off.
- An op that kept more than predicted is planned on what it kept from then on: its kind's cost
  model gains the bytes per token it kept beyond its graph, as a tensor the op saves, so
  recomputing or offloading the op takes them away as well (`CostModel.with_saved`).
- Within the micro-batch that shows it, each gate sees what the decoder layers before it, and the
  ops of its own layer that ran before it (attention, the norms, the router; Qwen2-MoE's shared
  expert), kept beyond their prediction (`Expected`): that comes out of the slack the gate decides
  with, so the gate escalates as it would for a routing spike.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import transformers

from .. import versions
from ..costmodel import Forward, OpId
from ..costmodel.graph import BlockGraph
from ..costmodel.linear import Load
from ..costmodel.mitigation import MitigationOptions, charged_form, device_bytes_by_op
from ..costmodel.model import CostModel
from ..costmodel.plan import Block, Plan


@dataclass(frozen=True)
class Miss:
    """An op whose forward kept other device bytes than its cost model predicted."""

    op: str
    measured: int
    predicted: int


EMBED = OpId(-1, "embed")
UNCONVERGED = 3  # forwards of one kind in a row that missed: the correction did not converge
SAVERS = ("torch", "transformers", "peft", "trl")  # the packages whose code decides what an op saves


def gate_pairs(cm: CostModel, routed: Mapping[int, float]) -> list[float] | None:
    """A forward's routed pairs as `cm` takes them, one per MoE layer; None (top-k per token)
    where a gate did not report (no MoE layer, or its forward raised before)."""
    return [routed[layer] for layer in cm.moe_layers] if all(layer in routed for layer in cm.moe_layers) else None


class Calibration:
    """The check after each forward, and what it has learnt: the ops of each kind of forward
    already reported, and the cost models corrected."""

    def __init__(self, family: str, weights: str):
        """`weights`: the model's weights in words (their dtype and device), for the messages."""
        self.family, self.weights = family, weights
        self._reported: set[tuple[object, object]] = set()
        self._predicted: dict[tuple, tuple[CostModel, dict[object, int], int]] = {}
        self._missed: dict[object, deque[int]] = {}  # kind -> the excesses of its last forwards that missed in a row
        self.failed: set[object] = set()  # kinds reported as not converging

    def check(
        self, forward: Forward, cm: CostModel, measured: Mapping[object, int], plan: Plan, options: MitigationOptions,
        ids_view_bytes: int = 0, varlen_bytes: int = 0,
    ) -> tuple[list[Miss], CostModel]:
        """The misses of `forward` (its routing as its gates saw it; its bytes per op `measured`),
        and `cm`, its kind's cost model, corrected where it kept more (`cm` itself otherwise). `ids_view_bytes`: what its
        token ids keep beyond themselves (`Provisioner._ids_view_bytes`); `varlen_bytes`: the
        varlen arguments its layers receive (`runtime.forward_kind.varlen_bytes`), kept where a
        region holds the layer arguments; both the embedding's.
        The forward's total decides:
        where two ops save one storage it may be charged to either, and what the layers receive
        (masks, position ids, the loss's token count) is charged to the embedding whichever block
        saves it first. A total that differs names the ops of the blocks that differ, and an
        excess goes to the op that kept the most beyond its prediction."""
        kind = forward.kind
        predicted, total = self._prediction(cm, forward, plan, options)
        held = ids_view_bytes + (varlen_bytes if varlen_bytes and cm.holds_arguments(plan) else 0)
        excess = sum(measured.values()) - total - held
        self._converging(kind, excess)
        if not excess:
            return [], cm
        if held:
            predicted = {**predicted, EMBED: predicted.get(EMBED, 0) + held}
        differ = [
            op for ops in _by_block(set(measured) | set(predicted)).values() if sum(measured.get(o, 0) - predicted.get(o, 0) for o in ops)
            for op in ops if measured.get(op, 0) != predicted.get(op, 0)
        ]
        misses = [Miss(str(op), measured.get(op, 0), predicted.get(op, 0)) for op in differ]
        for op, miss in zip(differ, misses):
            if (kind, op) not in self._reported:
                self._reported.add((kind, op))
                warnings.warn(
                    f"bagualu: op {op} of {self.family} kept {miss.measured} bytes where the cost model of its forwards "
                    f"({self._kind(kind)}) predicts {miss.predicted}; the micro-batch kept {excess:+d} bytes beyond its "
                    f"prediction in all. {_cause()}" + (
                        "; the next micro-batches are planned on the bytes measured" if excess > 0 else ""
                    ),
                    RuntimeWarning, stacklevel=3,
                )
        if excess <= 0:
            return misses, cm
        corrected = cm
        for ops in _by_block(differ).values():  # each block's excess to its op that kept the most beyond
            beyond = sum(measured.get(op, 0) - predicted.get(op, 0) for op in ops)
            owners = [op for op in ops if isinstance(op, OpId) and op.layer in cm.blocks]
            if beyond > 0 and owners:
                op = max(owners, key=lambda op: measured.get(op, 0) - predicted.get(op, 0))
                corrected = corrected.with_saved(op, beyond / forward.tokens, kept=plan.get(op, "keep") != "keep")  # mitigated, kept anyway
        return misses, corrected

    def _kind(self, kind: object) -> str:
        return f"{kind} over {self.weights}"

    def _converging(self, kind: object, excess: int) -> None:
        """Counts `kind`'s forwards that missed in a row; at `UNCONVERGED` the failure is
        reported, once per kind: planning on the measured bytes did not make them exact."""
        missed = self._missed.setdefault(kind, deque(maxlen=UNCONVERGED))  # a kind that keeps missing holds no more
        if not excess:
            missed.clear()
            return
        missed.append(excess)
        if len(missed) >= UNCONVERGED and kind not in self.failed:
            self.failed.add(kind)
            warnings.warn(
                f"bagualu: the cost model of {self.family}'s forwards ({self._kind(kind)}) did not converge: the last "
                f"{len(missed)} micro-batches of that kind each kept other bytes than predicted "
                f"({', '.join(f'{n:+d}' for n in missed)} bytes), each planned on what the ones before kept; its plans "
                f"may keep more than their budgets (the spill to host memory catches what passes the capacity). "
                f"{_cause()}",
                RuntimeWarning, stacklevel=4,
            )

    def _prediction(self, cm: CostModel, forward: Forward, plan: Plan, options: MitigationOptions) -> tuple[dict[object, int], int]:
        """`cm`'s bytes per op for `forward`, and their sum: remembered (up to 256 forwards'
        shapes, routings and plans), as the same ones come back every micro-batch."""
        key = (id(cm), forward, plan, options)
        hit = self._predicted.get(key)
        if hit is None or hit[0] is not cm:  # the entry holds its cost model: no other can take its id
            by_op = {op: round(n) for op, n in cm.device_bytes_by_op(forward, plan, options).items()}
            if len(self._predicted) >= 256:
                self._predicted.clear()
            hit = self._predicted[key] = (cm, by_op, sum(by_op.values()))
        return hit[1], hit[2]


def _cause() -> str:
    """What a miss most likely comes from: a release outside the tested range of a package that
    decides what ops save, else the cost model itself."""
    outside = [found for found in versions.untested() if found.split()[0] in SAVERS]
    if outside:
        return f"Cause: {', '.join(outside)}, a release that may save other tensors than the cost model describes"
    return (
        f"Cause: the cost model of this kind, not the release (torch {torch.__version__} and transformers "
        f"{transformers.__version__} are tested): please report it with the op's tensors (`bagualu profile`)"
    )


def _by_block(ops) -> dict[int | None, list]:
    """Ops by block, in program order (None: bytes charged outside any op)."""
    out: dict[int | None, list] = {}
    for op in sorted(ops, key=_order):
        out.setdefault(op.layer if isinstance(op, OpId) else None, []).append(op)
    return out


def _order(op: object) -> tuple:
    return (0, op.layer, op.name) if isinstance(op, OpId) else (1, 0, str(op))


class Expected:
    """What one forward's decoder layers are expected to keep, added up layer by layer as its gates
    come: at the gate of a layer every layer before it has run, under the plan in force, with its
    own gate's routing. (The embedding's block is left out: what the layers receive is charged to
    it when some region holds it, in whichever layer.) Where a block's plan keeps and recomputes
    only, its bytes are linear in the load (`charged_form`): at this forward's shape, a number and
    a number per routed pair, asked once per block and plan; else priced at each gate's load."""

    def __init__(self, cm: CostModel, forward: Forward, options: MitigationOptions):
        self.cm, self.tokens, self.seq_len, self.options = cm, forward.tokens, forward.seq_len, options
        self._layers = iter(sorted(i for i in cm.blocks if i >= 0))
        self._next = next(self._layers, None)
        self.bytes = 0.0
        self._rates: dict[tuple, tuple[float, float] | None] = {}  # (block, its plan, ops) -> bytes at no pairs, per pair

    def _charged(self, block: BlockGraph, own: Block, pairs: float | None, ops: frozenset[str] | None) -> float:
        """Bytes `block`'s `ops` (None: all of them) keep under its plan `own` with `pairs` routed
        (None: `tokens * top_k`)."""
        if block.kind != "moe":
            pairs = 0
        elif pairs is None:
            pairs = self.tokens * self.cm.pairs_per_token
        key = (id(block), own, ops)
        rate = self._rates.get(key, ())
        if rate == ():
            form = charged_form(block, dict(own), block.op_names if ops is None else ops, self.options)
            rate = self._rates[key] = None if form is None else (form.at(self._load(0)), form.per_routed)
        if rate is not None:
            return rate[0] + rate[1] * pairs
        by_op = device_bytes_by_op(block, dict(own), self._load(pairs), self.options)
        return sum(by_op.values()) if ops is None else sum(by_op.get(op, 0.0) for op in ops)

    def _load(self, pairs: float) -> Load:
        return Load.of(self.tokens, pairs, self.seq_len, self.cm.pairs_per_token)

    def before(self, layer: int, plan: Plan, routed: Mapping[int, float]) -> float:
        """Bytes the decoder layers before `layer` are expected to keep."""
        while self._next is not None and self._next < layer:
            i = self._next
            self.bytes += self._charged(self.cm.blocks[i], plan.block(i), routed.get(i), None)
            self._next = next(self._layers, None)
        return self.bytes

    def ran(self, layer: int, plan: Plan, pairs: float, ops: set[str]) -> float:
        """Bytes the ops `ops` of `layer`, which have run, are expected to keep under `plan` with
        `pairs` routed (at its gate: those before its routed experts, in the family's own order)."""
        return self._charged(self.cm.blocks[layer], plan.block(layer), pairs, frozenset(ops))
