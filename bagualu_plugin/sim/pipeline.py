"""One training iteration of the whole pipeline as a discrete-event simulation (paper §IV-A,
§VI): every rank runs its 1F1B order (`costmodel.pipeline.one_f_one_b`, nanotron's), one
operation at a time. F(mb) on rank r starts when r is free and F(mb) has finished on r - 1 and
its activations have crossed the P2P link; B(mb) on r when r is free and B(mb) has finished on
r + 1 and its gradients have crossed back (the last rank's B(mb) follows its own F(mb) in its
order). Memory is judged separately, by the same order (`costmodel.iteration_curve`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import Recipe
from ..costmodel.dims import DTYPE_BYTES
from ..costmodel.pipeline import one_f_one_b


def iteration_time(forward_s: Sequence[Sequence[float]], backward_s: Sequence[Sequence[float]], p2p_s: float) -> float:
    """Seconds from the first forward to the last backward: `forward_s[r][mb]`, `backward_s[r][mb]`
    are rank r's operation times, `p2p_s` the transfer of one micro-batch between neighbours."""
    pp, m = len(forward_s), len(forward_s[0])
    orders = [one_f_one_b(pp, r, m) for r in range(pp)]
    f_end: list[list[float | None]] = [[None] * m for _ in range(pp)]
    b_end: list[list[float | None]] = [[None] * m for _ in range(pp)]
    free, nxt = [0.0] * pp, [0] * pp
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for r in range(pp):
            order = orders[r]
            while nxt[r] < len(order):
                step = order[nxt[r]]
                mb = step.micro_batch
                if step.kind == "F":
                    dep = 0.0 if r == 0 else f_end[r - 1][mb]
                    ready = dep if r == 0 or dep is None else dep + p2p_s
                    took, ends = forward_s[r][mb], f_end[r]
                else:
                    dep = f_end[r][mb] if r == pp - 1 else b_end[r + 1][mb]
                    ready = dep if r == pp - 1 or dep is None else dep + p2p_s
                    took, ends = backward_s[r][mb], b_end[r]
                if ready is None:
                    break
                ends[mb] = free[r] = max(free[r], ready) + took
                nxt[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError("the 1F1B orders deadlocked: a rank waits on an operation no rank can run")
    return max(free)


def p2p_seconds(recipe: Recipe) -> float:
    """One micro-batch's hidden states (tokens x hidden x dtype bytes) over the link between
    pipeline neighbours: they are dp * tp devices apart (Megatron's rank order, pipeline
    outermost), inter-node once that reaches a node."""
    hw, m, par = recipe.hardware, recipe.model, recipe.parallel
    link = hw.inter_node_bandwidth if par.dp * par.tp >= hw.devices_per_node else hw.intra_node_bandwidth
    return recipe.batch.tokens * m.hidden_size * DTYPE_BYTES[m.dtype] / link
