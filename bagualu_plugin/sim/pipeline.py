"""One training iteration of the whole pipeline as a discrete-event simulation (paper §IV-A,
§VI): every rank runs its 1F1B order (`costmodel.pipeline.interleaved_one_f_one_b`: nanotron's
plain order at vp = 1, Megatron-LM's interleaved one with vp model chunks per rank), one
operation at a time. F(mb, c) on rank r starts when r is free and F(mb, c) has finished on
r - 1 and its activations have crossed the P2P link (on rank 0, F(mb, c - 1) on the last rank:
chunks wrap around the ring); B(mb, c) on r when r is free and B(mb, c) has finished on r + 1
and its gradients have crossed back (on the last rank, B(mb, c + 1) on rank 0; the last
chunk's backward follows its own forward there). Memory is judged separately, by the same
order (`costmodel.iteration_curve`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import Recipe
from ..costmodel.dims import DTYPE_BYTES
from ..costmodel.pipeline import interleaved_one_f_one_b


def iteration_time(forward_s: Sequence[Sequence[float]], backward_s: Sequence[Sequence[float]], p2p_s: float, vp: int = 1) -> float:
    """Seconds from the first forward to the last backward: `forward_s[r][mb * vp + c]`,
    `backward_s[r][mb * vp + c]` are rank r's operation times on chunk c of micro-batch mb,
    `p2p_s` the transfer of one micro-batch between neighbours."""
    pp, units = len(forward_s), len(forward_s[0])
    m = units // vp
    orders = [interleaved_one_f_one_b(pp, r, m, vp) for r in range(pp)]
    f_end: list[list[float | None]] = [[None] * units for _ in range(pp)]
    b_end: list[list[float | None]] = [[None] * units for _ in range(pp)]
    free, nxt = [0.0] * pp, [0] * pp

    def ready(step, r: int) -> float | None:
        """When `step`'s input is on rank r (None: not yet produced)."""
        mb, c = step.micro_batch, step.chunk
        if step.kind == "F":
            if r > 0:
                src = f_end[r - 1][mb * vp + c]
            elif c > 0:
                src = f_end[pp - 1][mb * vp + c - 1]
            else:
                return 0.0
        elif r < pp - 1:
            src = b_end[r + 1][mb * vp + c]
        elif c < vp - 1:
            src = b_end[0][mb * vp + c + 1]
        else:
            return f_end[r][mb * vp + c]
        return None if src is None else src + p2p_s

    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for r in range(pp):
            order = orders[r]
            while nxt[r] < len(order):
                step = order[nxt[r]]
                start = ready(step, r)
                if start is None:
                    break
                unit = step.micro_batch * vp + step.chunk
                took, ends = (forward_s, f_end) if step.kind == "F" else (backward_s, b_end)
                ends[r][unit] = free[r] = max(free[r], start) + took[r][unit]
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
