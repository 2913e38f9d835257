"""The §V-B dynamic program (`planner.dual_batch`): equal to brute force on small instances, the
order inside every class kept, the windows' times summing to the optimum, and the cache."""

import random

import pytest

from bagualu_plugin.config import check_pipeline
from bagualu_plugin.costmodel import Forward
from bagualu_plugin.planner.dual_batch import (
    CLASSES,
    ScheduleCache,
    StageTime,
    brute_force,
    solve,
    window_time,
)


def _instance(rng: random.Random, most: int) -> list[list[StageTime]]:
    """Stage lists that alternate compute and copy stages, as compaction at communication ops makes them."""
    classes = []
    for _ in CLASSES:
        n, first = rng.randint(0, most), rng.random() < 0.5
        classes.append([
            StageTime(compute_s=rng.uniform(0.1, 3.0)) if (s % 2 == 0) == first else StageTime(copy_s=rng.uniform(0.1, 3.0))
            for s in range(n)
        ])
    return classes


@pytest.mark.parametrize("seed", range(40))
def test_the_dp_equals_brute_force_and_keeps_every_class_in_order(seed):
    stages = _instance(random.Random(seed), 2 if seed % 2 else 3)
    schedule = solve(stages)
    if sum(map(len, stages)) <= 7:  # brute force enumerates every path: small instances only
        assert schedule.time_s == pytest.approx(brute_force(stages))
    for c, run in enumerate(stages):  # each class's stages exactly once, in program order
        assert [s for cls, s in schedule.order() if cls == CLASSES[c]] == list(range(len(run)))
    windows = sum(window_time([run[a:b] for run, (a, b) in zip(stages, w)]) for w in schedule.windows)
    assert windows == pytest.approx(schedule.time_s)
    assert schedule.time_s <= schedule.serial_s + 1e-12
    assert schedule.serial_s == pytest.approx(sum(window_time([run]) for run in stages))


def test_overlap_hides_copies_behind_compute():
    """Forward compute and an offload's copies run at once: the time is the longer stream's."""
    f, o = [StageTime(compute_s=2.0), StageTime(compute_s=2.0)], [StageTime(copy_s=1.5), StageTime(copy_s=1.5)]
    schedule = solve([f, [], o, []])
    assert schedule.time_s == pytest.approx(4.0) and schedule.serial_s == pytest.approx(7.0)


def test_a_pipeline_of_two_or_fewer_stages_is_refused():
    for pp in (1, 2):
        with pytest.raises(ValueError, match=r"x - y > 2.*pp=" + str(pp)):
            check_pipeline(pp)
    check_pipeline(3)


def _small_cost_model():
    from bagualu_plugin.costmodel import CostModel, ModelDims, Parallel
    from bagualu_plugin.hardware import preset

    dims = ModelDims(family="qwen3_moe", hidden_size=256, num_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, vocab_size=1024, num_experts=8, top_k=2, moe_intermediate_size=128, qk_norm=True)
    return CostModel.from_config(dims, preset("h100"), Parallel(dp=2, ep=2))


def test_the_cache_solves_each_block_once_and_equals_solving_the_point():
    """A point's schedule from the cache is the point solved block by block from the cost model,
    each distinct block's stages solved once; a second point whose plans differ in one block
    solves that block alone again."""
    from bagualu_plugin.costmodel import OpId
    from bagualu_plugin.costmodel.plan import Plan
    from bagualu_plugin.planner.dual_batch import piece_stages, point_stages, solve_blocks

    cm = _small_cost_model()
    tokens = seq = 4096
    moe = cm.moe_layers
    offload = Plan({OpId(i, "expert_fc1"): "offload" for i in moe})
    recompute = Plan({OpId(i, n): "recompute" for i in moe for n in ("expert_fc1", "expert_act", "expert_fc2")})
    cache = ScheduleCache([cm])
    plans = [recompute, recompute, offload, recompute]

    def distinct(blocks) -> set:
        return {tuple(map(tuple, stages)) for stages in blocks}

    blocks = piece_stages(point_stages(cm, *plans, tokens, seq_len=seq))
    solved = distinct(blocks)
    assert 1 < len(solved) < len(cm.blocks)  # the MoE blocks in the middle run the same stages
    schedule, hit = cache.get(tokens, seq, (0, 0, 0, 0), plans)
    assert not hit and cache.misses == len(solved) and cache.hits == len(cm.blocks) - len(solved)
    assert schedule == solve_blocks(blocks)
    assert cache.get(tokens, seq, (0, 0, 0, 0), plans) == (schedule, True)
    # x's plan recomputes one more op: its forward (F) runs as before, nothing is solved again
    more = [Plan({**recompute, OpId(moe[-1], "attn_core"): "recompute"}), *plans[1:]]
    assert cache.get(tokens, seq, (0, 0, 0, 0), more) == (schedule, True) and cache.misses == len(solved)
    # x-1's plan offloads more in its last MoE layer only: O's copies change at that block alone
    changed = [*plans[:2], Plan({**offload, OpId(moe[-1], "expert_fc2"): "offload"}), plans[3]]
    other, hit = cache.get(tokens, seq, (0, 0, 0, 0), changed)
    changed_blocks = piece_stages(point_stages(cm, *changed, tokens, seq_len=seq))
    assert not hit and len(distinct(changed_blocks) - solved) == 1 and cache.misses == len(solved) + 1
    assert other == solve_blocks(changed_blocks)
    assert cache.hit_rate == pytest.approx(1 - (len(solved) + 1) / (4 * len(cm.blocks)))


def test_a_scheduling_point_s_stages_come_from_the_cost_model():
    """Under expert parallelism a forward's compute is split at every dispatch and combine; the
    offload of x-1 is copies, the recovery of y+1 reloads and recompute; the stage totals are the
    cost model's times. Solved block by block, the point is no faster than the whole DP allows and
    faster than the classes one after another."""
    from bagualu_plugin.costmodel import OpId
    from bagualu_plugin.planner.dual_batch import joined, point_stages, solve_blocks

    cm = _small_cost_model()
    moe, tokens, seq = cm.moe_layers, 4096, 4096
    offload = {OpId(i, "expert_fc1"): "offload" for i in moe}
    recompute = {OpId(i, n): "recompute" for i in moe for n in ("expert_fc1", "expert_act", "expert_fc2")}
    blocks = point_stages(cm, recompute, recompute, offload, recompute, tokens, seq_len=seq)
    assert len(blocks) == len(cm.blocks)
    f, b, o, r = joined(blocks)
    assert sum(s.copy_s > 0 for s in f) == 2 * len(moe) and sum(s.copy_s > 0 for s in b) == 2 * len(moe)
    assert all((s.compute_s == 0) != (s.copy_s == 0) for run in (f, b, o, r) for s in run)  # one stream per stage
    assert all(s.compute_s == 0 for s in o) and len(o) == len(moe)  # one run of copies per offloading block
    loads = cm.loads(Forward(tokens, seq))
    forward = sum(op.forward_s.at(loads[i]) for i, blk in cm.blocks.items() for op in blk.ops)
    assert sum(s.compute_s + s.copy_s for s in f) == pytest.approx(forward)
    unit = [OpId(moe[0], n) for n in ("expert_fc1", "expert_act", "expert_fc2")]
    assert sum(s.compute_s for s in r) == pytest.approx(len(moe) * cm.mitigation_cost(unit, "recompute", Forward(tokens, seq)).backward_s)
    copies = sum(cm.mitigation_cost(op, "offload", Forward(tokens, seq)).forward_s for op in offload)
    assert sum(s.copy_s for s in o) == pytest.approx(copies) and not joined(point_stages(cm, {}, {}, {}, offload, tokens, seq_len=seq))[2]
    stages, blockwise = [f, b, o, r], solve_blocks(blocks)
    for c, run in enumerate(stages):  # the joined windows still keep every class in order
        assert [s for cls, s in blockwise.order() if cls == CLASSES[c]] == list(range(len(run)))
    assert solve(stages).time_s <= blockwise.time_s + 1e-12 < blockwise.serial_s


@pytest.mark.multiprocess
def test_the_benchmark_prints_every_table_ii_preset():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "dual_batch.py"), "--iterations", "2"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("glm-")]
    assert len(rows) == 8 and all(sum(word.endswith("x") for word in line.split()) == 2 for line in rows)  # point, iteration
