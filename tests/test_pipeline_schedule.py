"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages, as the paper trains, §VI-A) against
schedules worked out by hand, and the properties every rank's order must have."""

import pytest

from bagualu_plugin.config import Recipe
from bagualu_plugin.costmodel import MicroBatchCost, iteration_curve, release_order
from bagualu_plugin.costmodel.pipeline import Step, fused_points, interleaved_one_f_one_b, one_f_one_b, stage_layers, warmup_depth
from bagualu_plugin.planner import BudgetState
from bagualu_plugin.stage import Stage


def _steps(text: str) -> list[Step]:
    """'F0.1' is the forward of micro-batch 0 on chunk 1; phases are separated by '|'."""
    warmup, steady, cooldown = text.split("|")
    return [
        Step(token[0], int(token[1:].split(".")[0]), phase, int(token.split(".")[1]))
        for phase, part in zip(("warmup", "steady", "cooldown"), (warmup, steady, cooldown), strict=True)
        for token in part.split()
    ]


# By hand: forwards run micro-batches in groups of pp, chunk 0 of the group then chunk 1, so the k-th
# forward is micro-batch (k // (pp*vp)) * pp + k % pp on chunk (k % (pp*vp)) // pp; the k-th backward
# is the same micro-batch on chunk vp - 1 - that. Rank r runs (pp - r - 1) * 2 + (vp - 1) * pp warmup
# forwards (at most m * vp), then forward k + warmup / backward k pairs, then the remaining backwards.
HAND = [
    # pp=2, vp=2, m=4, rank 0: warmup 2 + 2 = 4
    (2, 0, 4, "F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 | B2.1 B3.1 B2.0 B3.0"),
    # pp=2, vp=2, m=4, rank 1: warmup 0 + 2 = 2
    (2, 1, 4, "F0.0 F1.0 | F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 | B2.0 B3.0"),
    # pp=4, vp=2, m=4, rank 0: warmup 6 + 4 = 10 > 8 chunk forwards, so all 8 run first
    (4, 0, 4, "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 | | B0.1 B1.1 B2.1 B3.1 B0.0 B1.0 B2.0 B3.0"),
    # pp=4, vp=2, m=4, rank 3: warmup 0 + 4 = 4
    (4, 3, 4, "F0.0 F1.0 F2.0 F3.0 | F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 | B0.0 B1.0 B2.0 B3.0"),
]


@pytest.mark.parametrize("pp, rank, m, text", HAND, ids=[f"pp{c[0]}-rank{c[1]}-m{c[2]}" for c in HAND])
def test_interleaved_schedule_matches_hand_worked_order(pp, rank, m, text):
    assert interleaved_one_f_one_b(pp, rank, m, vp=2) == _steps(text)


@pytest.mark.parametrize(
    "pp, rank, m, vp, depth",
    [(2, 0, 4, 2, 5), (2, 1, 4, 2, 3), (4, 0, 4, 2, 8), (4, 3, 4, 2, 5), (4, 1, 8, 2, 9), (4, 0, 8, 3, 15), (4, 0, 2, 1, 2)],
)
def test_warmup_depth_counts_the_first_steady_forward(pp, rank, m, vp, depth):
    """Warmup chunk forwards plus the first steady one, as Stage.warmup counts for plain 1F1B."""
    assert warmup_depth(pp, rank, m, vp) == depth


@pytest.mark.parametrize("pp, rank, m", [(1, 0, 5), (2, 0, 1), (4, 1, 6), (4, 3, 8), (8, 0, 3), (8, 5, 32)])
def test_one_chunk_is_plain_one_f_one_b(pp, rank, m):
    assert interleaved_one_f_one_b(pp, rank, m, vp=1) == one_f_one_b(pp, rank, m)
    assert warmup_depth(pp, rank, m) == min(pp - rank, m)
    assert all(s.chunk == 0 for s in one_f_one_b(pp, rank, m))


SHAPES = [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (4, 4, 16), (3, 2, 9), (8, 2, 8)]  # (pp, vp, m)


@pytest.mark.parametrize("pp, vp, m", SHAPES)
def test_every_chunk_runs_forward_then_backward_once_and_in_flight_stays_within_warmup_depth(pp, vp, m):
    for rank in range(pp):
        steps = interleaved_one_f_one_b(pp, rank, m, vp)
        work = [(s.micro_batch, s.chunk) for s in steps]
        everything = {(mb, c) for mb in range(m) for c in range(vp)}
        assert sorted(w for s, w in zip(steps, work, strict=True) if s.kind == "F") == sorted(everything)
        assert sorted(w for s, w in zip(steps, work, strict=True) if s.kind == "B") == sorted(everything)
        alive, peak = set(), 0
        for s in steps:
            if s.kind == "F":
                alive.add((s.micro_batch, s.chunk))
                peak = max(peak, len(alive))
            else:
                alive.remove((s.micro_batch, s.chunk))  # KeyError: a backward before its forward
        assert peak == warmup_depth(pp, rank, m, vp)


@pytest.mark.parametrize("pp, vp, m", SHAPES)
def test_ranks_orders_compose_into_a_pipeline_without_deadlock(pp, vp, m):
    """Each rank runs its list in order; a chunk forward waits for the previous virtual stage's, a
    backward for the next virtual stage's backward. Every step must eventually run."""
    orders = [interleaved_one_f_one_b(pp, rank, m, vp) for rank in range(pp)]
    done: set[tuple[str, int, int]] = set()
    position = [0] * pp
    last = pp * vp - 1
    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        progressed = False
        for rank, order in enumerate(orders):
            if position[rank] == len(order):
                continue
            s = order[position[rank]]
            stage = s.chunk * pp + rank
            if s.kind == "F":
                ready = stage == 0 or ("F", s.micro_batch, stage - 1) in done
            else:
                ready = ("F", s.micro_batch, stage) in done and (stage == last or ("B", s.micro_batch, stage + 1) in done)
            if ready:
                done.add((s.kind, s.micro_batch, stage))
                position[rank] += 1
                progressed = True
        assert progressed, f"deadlock at positions {position}"


def test_chunks_hold_interleaved_virtual_stages():
    # 8 layers, pp=2, vp=2: virtual stages 0..3 of 2 layers; chunk c of rank r is stage c * 2 + r
    assert [list(stage_layers(8, 2, r, vp=2, chunk=c)) for c in range(2) for r in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(8, 4, 1) == range(2, 4)  # without chunks, an equal contiguous share
    with pytest.raises(ValueError, match=r"chunk=2, vp=2"):
        stage_layers(8, 2, 0, vp=2, chunk=2)
    with pytest.raises(ValueError, match=r"pp\*vp=12 virtual stages \(pp=4, vp=3\)"):
        stage_layers(8, 4, 0, vp=3)
    with pytest.raises(ValueError, match="rank=2, pp=2"):
        stage_layers(8, 2, 2, vp=2)


@pytest.mark.parametrize(
    "pp, rank, m, vp, fragment",
    [
        (2, 0, 4, 0, "vp must be >= 1, got 0"),
        (2, 2, 4, 2, "rank=2, pp=2"),
        (2, 0, 0, 2, "micro_batches must be >= 1, got 0"),
        (4, 0, 6, 2, "micro_batches must be a multiple of pp=4"),
        (1, 0, 4, 2, "needs pp >= 2, got pp=1"),
    ],
)
def test_bad_arguments_name_the_argument(pp, rank, m, vp, fragment):
    with pytest.raises(ValueError, match=fragment):
        interleaved_one_f_one_b(pp, rank, m, vp)
    with pytest.raises(ValueError, match=fragment):
        warmup_depth(pp, rank, m, vp)


def _tiny(vp: int, rank: int = 0) -> Recipe:
    return Recipe.from_dict(
        {
            "hardware": "h100",
            "model": {
                "family": "glm4_moe",
                "hidden_size": 64,
                "num_layers": 8,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "vocab_size": 128,
                "num_experts": 4,
                "top_k": 2,
                "moe_intermediate_size": 32,
            },
            "pipeline": {"pp": 2, "rank": rank, "micro_batches": 4, "vp": vp},
            "batch": {"seq_len": 16},
        }
    )


def test_interleaved_stage_holds_its_chunks_and_counts_chunk_forwards():
    """pp=2, vp=2, 8 layers: rank 0 holds chunks [0, 1] + embedding and [4, 5]; rank 1 [2, 3] and
    [6, 7] + LM head. Static bytes are the whole rank's, M0 the largest chunk's, B_w 5 chunk forwards."""
    first, last = Stage.of(_tiny(2)), Stage.of(_tiny(2, rank=1))
    assert [c.layers for c in first.chunks] == [[0, 1], [4, 5]] and [c.layers for c in last.chunks] == [[2, 3], [6, 7]]
    assert -1 in first.chunks[0].blocks and 8 in last.chunks[1].blocks and 8 not in last.chunks[0].blocks
    assert first.chunks[1].blocks[-1].kind == "embed" and first.chunks[1].blocks[-1].dense_params == 0  # RoPE tables only
    assert first.cost.parameter_counts() == tuple(map(sum, zip(*(c.parameter_counts() for c in first.chunks))))
    plain = Stage.of(_tiny(1))
    assert first.static_bytes == plain.static_bytes and first.cost.layers == [0, 1, 4, 5]
    seq = first.recipe.batch.seq_len
    m0 = [c.activation_bytes(first.tokens, seq_len=seq, plan=c.full_recompute()) for c in first.chunks]
    assert first.min_budget == max(m0) and first.chunk(1).cost is first.chunks[1]
    assert (first.warmup, last.warmup, plain.warmup) == (5, 3, 2)
    assert [(s.kind, s.micro_batch, s.chunk) for s in first.schedule[:6]] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1)
    ]
    curve = first.curve()
    assert len(curve.steps) == 16 and curve.in_flight_at_peak == 5
    with pytest.raises(ValueError, match=r"chunk must be in \[0, 2\) \(pipeline.vp\), got 2"):
        first.chunk(2)
    with pytest.raises(ValueError, match=r"pipeline.vp=2: a rank's own model .* use vp=1 to train"):
        Stage.of(_tiny(2), first.cost, split=False)


def test_release_order_by_hand():
    """Rank 0 of pp=2, vp=2, m=4 (HAND[0]): forwards F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 F2.1 F3.1 at
    positions 0-7; B0.1 runs before F3.0, B1.1 before F2.1, B0.0 before F3.1. Plain 1F1B frees
    forward k - B_w before forward k."""
    assert release_order(interleaved_one_f_one_b(2, 0, 4, 2)) == (2, 3, 0)
    assert release_order(one_f_one_b(4, 1, 6)) == (0, 1, 2)
    with pytest.raises(ValueError, match="follows 2 backwards"):
        release_order(_steps("F0.0 | B0.0 B1.0 F1.0 | B1.0"))


@pytest.mark.parametrize("pp, rank, m, vp", [(2, 0, 4, 2), (2, 1, 4, 2), (4, 0, 8, 2), (4, 1, 8, 3), (4, 3, 12, 2), (4, 0, 6, 1)])
def test_algorithm_1_fills_capacity_exactly_in_the_interleaved_order(pp, rank, m, vp):
    """Chunk forwards keep all Algorithm 1 gives them, or a third or a half of it: the curve of the
    schedule then peaks at the capacity exactly, never above. Freeing in plain 1F1B's order
    instead overshoots it (it frees the wrong chunk's bytes)."""
    capacity, static, m0 = 10_000, 1_000, 10
    schedule = interleaved_one_f_one_b(pp, rank, m, vp)
    warmup = warmup_depth(pp, rank, m, vp)

    def peak(released) -> float:
        state, kept = BudgetState.start(capacity, static, m0, warmup, released), [0] * (m * vp)
        for k, step in enumerate(s for s in schedule if s.kind == "F"):
            kept[step.micro_batch * vp + step.chunk] = actual = state.budget(k) // (1 + k % 3)
            state = state.after_forward(k, actual)
        return iteration_curve([MicroBatchCost(1.0, 1.0, b) for b in kept], pp, rank, static, vp).peak_bytes

    assert peak(release_order(schedule)) == capacity
    if (pp, m, vp) != (2, 4, 2) and vp > 1:  # m = pp: too few steady forwards to tell the orders apart
        assert peak(None) > capacity


def test_fused_points_pair_each_forward_with_the_next_micro_batch_s_backward():
    """The dual-batch executor's points (§V-B): rank 0 of 4 fuses F3 B0, F4 B1, F5 B2; the last
    rank's forward and backward are of one micro-batch, so it fuses nothing."""
    points = [(f.micro_batch, b.micro_batch) for f, b in fused_points(one_f_one_b(4, 0, 6)) if b is not None]
    assert points == [(3, 0), (4, 1), (5, 2)]
    alone = [(s.kind, s.micro_batch) for s, b in fused_points(one_f_one_b(4, 0, 6)) if b is None]
    assert alone == [("F", 0), ("F", 1), ("F", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert all(b is None for _, b in fused_points(one_f_one_b(4, 3, 6)))
