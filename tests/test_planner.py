"""Algorithms 1 and 2 of paper §V-A against hand-worked cases."""

import pytest

from bagualu_plugin.costmodel import BlockGraph, CostModel, LinearForm, OpId, OpSpec, TensorSpec
from bagualu_plugin.hardware import HardwareSpec
from bagualu_plugin.planner import BudgetState, InfeasibleBudget, plan_micro_batch


def test_algorithm_1_by_hand():
    # M_max 100, static 20, M0 5, four micro-batches stack before the first backward
    s = BudgetState.start(capacity=100, static_bytes=20, min_budget=5, warmup=4)
    assert s.budget(0) == (100 - 20 - 4 * 5) // 4 + 5 == 20
    s = s.after_forward(0, 18)  # actual replaces the budget: used 38
    assert s.budget(1) == (100 - 38 - 3 * 5) // 3 + 5 == 20
    assert s.headroom(1) == 100 - 38 - 2 * 5 - 20 == 32  # what micro-batches 2 and 3 can give up
    s = s.after_forward(1, 25)  # a spike: the later warmup budgets shrink, nothing cascades
    assert s.budget(2) == (100 - 63 - 2 * 5) // 2 + 5 == 18
    s = s.after_forward(2, 18)
    assert s.budget(3) == 100 - 81 - 5 + 5 == 19
    assert s.headroom(3) == 0  # the last warmup micro-batch takes all that is left
    s = s.after_forward(3, 19)  # memory full: 20 + 18 + 25 + 18 + 19
    assert s.used == 100
    assert s.budget(4) == 18  # steady: the backward of micro-batch 0 freed 18
    assert s.headroom(4) == 0
    s = s.after_forward(4, 10)
    assert s.budget(5) == 100 - (92 - 25) == 33  # micro-batch 1's 25 come back
    assert s.budgets == (18, 25, 18, 19, 10)


def test_algorithm_1_rejects_impossible_inputs():
    with pytest.raises(ValueError, match=r"cannot hold static memory 90 plus 4 in-flight.*M0 = 5.*10 bytes short"):
        BudgetState.start(capacity=100, static_bytes=90, min_budget=5, warmup=4)
    s = BudgetState.start(capacity=100, static_bytes=0, min_budget=5, warmup=2)
    with pytest.raises(ValueError, match="out of order"):
        s.budget(1)


def _model() -> CostModel:
    """One block: a -> b -> c. a saves x (block input, 400 B) and its internal w (400 B); b saves
    y (made by a, 400 B, shared with c); c saves z (made by c, 800 B). Offload is slow, FP8 fast."""
    per = lambda n: LinearForm(const=n)  # noqa: E731
    block = BlockGraph(
        "moe",
        ops=(
            OpSpec("a", ("x",), per(1e-3), per(2e-3)),
            OpSpec("b", ("y",), per(1e-3), per(2e-3)),
            OpSpec("c", ("y",), per(1e-3), per(2e-3)),
        ),
        tensors=(
            TensorSpec("x", "input", ("a",), per(100), 4),
            TensorSpec("w", "a", ("a",), per(100), 4),
            TensorSpec("y", "a", ("b", "c"), per(100), 4),
            TensorSpec("z", "c", ("c",), per(200), 4),
        ),
    )
    hw = HardwareSpec(
        name="t", peak_flops=1e12, capacity_bytes=1 << 20, hbm_bandwidth=1e9, host_link_bandwidth=1e6,
        intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, devices_per_node=1, kernel_launch_s=1e-6, copy_launch_s=1e-6,
    )
    return CostModel({0: block}, hw, pairs_per_token=0)


def test_algorithm_2_takes_the_largest_reduction_first():
    cm = _model()
    assert cm.activation_bytes(1) == 2000  # x 400 + w 400 + y 400 + z 800
    # Reductions from nothing mitigated: recompute c drops z (c made it; y stays as its input):
    # 800 B for c's forward again (1 ms); offload a moves x and w: 800 B for 4 copies (1.6 ms);
    # offload or FP8 of c would leave y behind for b: a conflict. Equal reductions: the cheaper.
    d = plan_micro_batch(cm, 1500, tokens=1)
    assert dict(d.plan) == {OpId(0, "c"): "recompute"} and d.activation_bytes == 1200 and d.steps == 1
    assert d.backward_extra_s == pytest.approx(1e-3)
    # Re-evaluated on the new plan: offloading a would free its 800 B only to need them back when
    # its backward brings the copies back (room the budget holds): no reduction. FP8 of a keeps
    # x and w as 100 one-byte codes and one 4-byte scale each: 1200 - 800 + 2 x 104 = 608 B.
    d = plan_micro_batch(cm, 1000, tokens=1)
    assert dict(d.plan) == {OpId(0, "c"): "recompute", OpId(0, "a"): "fp8"} and d.activation_bytes == 608
    assert d.reload_bytes == 0 and d.steps == 2


def test_algorithm_2_rejects_conflicting_candidates_and_reports_infeasible_budgets():
    cm = _model()
    # Offloading a keeps 1200 B and needs its 800 B back in backward: 2000 B, as many as before.
    f = cm.footprint(1, plan={OpId(0, "a"): "offload"})
    assert (f.device_bytes, f.reload_bytes, f.needed_bytes) == (1200, 800, 2000)
    # Offload only: a is still taken (it frees 800 B of what stays on the device, room for the
    # next offloads; c ties but is later in op order); then c's offload would conflict with b
    # keeping y (case 2 of section V-A): rejected, not applied, and nothing else is left.
    with pytest.raises(InfeasibleBudget, match=r"budget 1300 bytes .* at best 2000 bytes for 1 tokens"):
        plan_micro_batch(cm, 1300, tokens=1, strategies=("offload",))
    with pytest.raises(ValueError, match="strategies: unknown"):
        plan_micro_batch(cm, 1100, tokens=1, strategies=("zip",))


def test_cached_planner_serves_repeated_budgets_with_plans_that_fit():
    from bagualu_plugin.planner import CachedPlanner

    cm = _model()
    planner = CachedPlanner(cm, budget_quantum=100, routed_quantum=1)
    first = planner.plan(1550, tokens=1)
    again = planner.plan(1580, tokens=1)  # same 100-byte bucket: served from the cache
    assert again is first and (planner.hits, planner.misses) == (1, 1)
    assert first.activation_bytes <= 1500  # planned for the bucket's floor, so it fits both
    planner.plan(1000, tokens=1)
    assert planner.misses == 2
    with pytest.raises(ValueError, match="quanta"):
        CachedPlanner(cm, budget_quantum=0)
