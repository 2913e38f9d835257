"""Deferred planning at gate time (paper §V-A): right after a MoE router has run, the local routed
pairs of its layer are known and its experts have not run yet. The micro-batch was planned for
`planned` pairs; the pairs beyond that cost `bytes_per_pair` each under its plan. If they fit the
slack left under the budget, nothing changes. In warmup the later warmup micro-batches can give
bytes up (their budgets shrink after this forward, each keeping M0): that headroom absorbs the
overrun before anything is recomputed. Otherwise the layer's routed experts are recomputed as one
unit, which keeps nothing per routed pair in one process (under expert parallelism it holds the
rows dispatch received, so the caller prices it at the pairs that arrived). Pure arithmetic:
numbers in, a decision out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GateDecision:
    action: Literal["fits", "defer", "escalate"]
    overrun: float  # bytes the arrived pairs need beyond the slack; 0 when they fit
    slack: float  # bytes the micro-batch may still add under its budget, after the decision
    headroom: float  # bytes later warmup micro-batches can still give up, after the decision


def at_gate(
    pairs: float, planned: float, bytes_per_pair: float, escalation_bytes: float, slack: float, headroom: float
) -> GateDecision:
    """What to do when `pairs` local routed pairs reach a layer planned for `planned`.
    `escalation_bytes`: what the layer keeps with its experts recomputed and `pairs` arrived,
    minus what its plan keeps at `planned` pairs (negative: it saves)."""
    extra = (pairs - planned) * bytes_per_pair
    if extra <= slack:  # fewer pairs than planned give nothing back: the plan's estimate stands
        return GateDecision("fits", 0.0, slack - max(extra, 0.0), headroom)
    overrun = extra - slack
    if overrun <= headroom:
        return GateDecision("defer", overrun, 0.0, headroom - overrun)
    return GateDecision("escalate", overrun, slack - escalation_bytes, headroom)
