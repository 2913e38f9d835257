"""Algorithms 1 and 2 of paper §V-A against hand-worked cases."""

import pytest

from bagualu_plugin.config import load_recipe
from bagualu_plugin.costmodel import BlockGraph, CostModel, Forward, LinearForm, OpId, OpSpec, TensorSpec
from bagualu_plugin.hardware import HardwareSpec
from bagualu_plugin.planner import BudgetState, GatePlan, InfeasibleBudget, at_gate, escalated, gate_costs, plan_for_gates, plan_micro_batch
from bagualu_plugin.stage import Stage


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
    assert s.budgets == [18, 25, 18, 19, 10]


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
    # x and w as 100 one-byte codes and one 4-byte scale each (1200 - 800 + 2 x 104 = 608 B), but
    # its backward needs them back at full precision beside those: 1408 B. Recomputing a drops w
    # (it made it) and holds x, its input: 800 B.
    assert cm.footprint(Forward(1), plan={OpId(0, "c"): "recompute", OpId(0, "a"): "fp8"}).needed_bytes == 608 + 800
    d = plan_micro_batch(cm, 1000, tokens=1)
    assert dict(d.plan) == {OpId(0, "c"): "recompute", OpId(0, "a"): "recompute"} and d.activation_bytes == 800
    assert d.room_bytes == 0 and d.steps == 2


def _gated(plan, gates):
    """`plan_for_gates`'s planner from Algorithm 2 at a budget (`plan`) and a plan's gates (`gates`)."""

    def served(budget):
        try:
            return gates(plan(budget)), True
        except InfeasibleBudget as exc:
            return gates(exc.best), False

    return served


def test_algorithm_2_rejects_conflicting_candidates_and_reports_infeasible_budgets():
    cm = _model()
    # Offloading a keeps 1200 B and needs its 800 B back in backward: 2000 B, as many as before.
    f = cm.footprint(Forward(1), plan={OpId(0, "a"): "offload"})
    assert (f.device_bytes, f.reload_bytes, f.needed_bytes) == (1200, 800, 2000)
    # Offload only: a is still taken (it frees 800 B of what stays on the device, room for the
    # next offloads; c ties but is later in op order); then c's offload would conflict with b
    # keeping y (case 2 of section V-A): rejected, not applied, and nothing else is left.
    with pytest.raises(InfeasibleBudget, match=r"budget 1300 bytes .* at best 2000 bytes for 1 tokens") as err:
        plan_micro_batch(cm, 1300, tokens=1, strategies=("offload",))
    best = err.value.best
    assert dict(best.plan) == {OpId(0, "a"): "offload"} and best.activation_bytes + best.room_bytes == 2000
    # the gates' planning runs that plan rather than stopping: lighter routing than planned may fit
    gates, slack = plan_for_gates(
        _gated(lambda b: plan_micro_batch(cm, b, tokens=1, strategies=("offload",)), lambda d: GatePlan.of(d, {}, 0.0, 0.0)), 1300, 0.0, 0.0
    )
    assert gates.decision == best and slack == -700 and gates.after == {} and gates.need == 0
    with pytest.raises(ValueError, match="strategies: unknown"):
        plan_micro_batch(cm, 1100, tokens=1, strategies=("zip",))


def test_path_planner_serves_repeated_budgets_with_plans_that_fit():
    from bagualu_plugin.planner import PathPlanner

    cm = _model()
    planner = PathPlanner(cm, budget_quantum=100, routed_quantum=1)
    first = planner.plan(1550, tokens=1)
    again = planner.plan(1580, tokens=1)  # same 100-byte bucket: the same plan on the same path
    assert again == first and again.plan is first.plan and (planner.answers, planner.paths) == (2, 1)
    assert first.activation_bytes <= 1500  # planned for the bucket's floor, so it fits both
    planner.plan(1000, tokens=1)  # further along the same path
    assert planner.paths == 1
    with pytest.raises(ValueError, match="quanta"):
        PathPlanner(cm, budget_quantum=0)


def test_plans_leave_each_gate_what_it_needs_at_the_heaviest_routing():
    """GLM-319B-A30B, rank 0, chunk 2 (layer 16 alone, under expert parallelism), at a steady-phase
    budget of 925 MiB. Algorithm 2 for the normal band (1.2x) leaves 235 MiB, but at a 2.6x spike
    the escalated layer still grows by 269 MiB (the dispatched rows it holds): that plan would
    overrun. `plan_for_gates` plans again leaving the gate its bytes; at 2.6x its plan then fits
    (escalated where it keeps bytes per routed pair)."""
    stage = Stage.of(load_recipe("glm-319b-a30b")).chunk(2)
    cm, tokens, seq, options = stage.cost, stage.tokens, stage.recipe.batch.seq_len, stage.options
    (layer,) = cm.moe_layers
    balanced = tokens * cm.pairs_per_token
    planned, heaviest, budget = 1.2 * balanced, 2.6 * balanced, 925 << 20
    strategies = stage.recipe.strategies.allowed

    def plan(b: float):
        return plan_micro_batch(cm, b, tokens, [planned], seq, strategies, options)

    def costs(p):
        return gate_costs(cm, p, tokens, seq, planned, options)

    def gates_of(d, heaviest=heaviest):
        return GatePlan.of(d, costs(d.plan), planned, heaviest)

    def kept_at_spike(p) -> float:
        return cm.footprint(Forward(tokens, seq, [heaviest]), escalated(p, layer), options).needed_bytes

    first = plan(budget)
    assert budget - first.activation_bytes - first.room_bytes < costs(first.plan)[layer].escalation_bytes(heaviest, planned)
    assert kept_at_spike(first.plan) > budget
    gates, slack = plan_for_gates(_gated(plan, gates_of), budget, planned, heaviest)
    assert gates.decision.plan != first.plan and gates.after == {layer: 0.0}
    c = gates.costs[layer]
    assert slack >= gates.need == c.escalation_bytes(heaviest, planned) > 0
    decision = at_gate(heaviest, planned, c.per_pair, c.escalation_bytes(heaviest, planned), slack, 0.0, gates.after[layer])
    assert decision.action in ("fits", "escalate") and decision.slack >= 0
    assert kept_at_spike(gates.decision.plan) <= budget
    unspiked, _ = plan_for_gates(_gated(plan, lambda d: gates_of(d, planned)), budget, planned, planned)
    assert unspiked.decision.plan == first.plan  # no spikes to leave room for


def test_algorithm_2_fits_what_full_recompute_keeps():
    """GLM-423B-A30B at 8K tokens, rank 0's first chunk, at what full recompute keeps: Algorithm 2
    fits it (by its greedy's path, or full recompute where that path stops above it); with room to
    spare the greedy's own mix is the plan.
    Under expert parallelism M0 is below that (the floor the gates reach together, nothing per
    routed pair): no plan one rank makes alone fits it, and the best, where the gates' collective
    escalations start, keeps no more than full recompute."""
    recipe = load_recipe("glm-423b-a30b")
    recipe = recipe.model_copy(update={"batch": recipe.batch.model_copy(update={"seq_len": 8192})})
    stage = Stage.of(recipe).chunk(0)
    cm, tokens, seq, options = stage.cost, stage.tokens, stage.recipe.batch.seq_len, stage.options
    routed = 1.2 * tokens * cm.pairs_per_token
    strategies = stage.recipe.strategies.allowed
    whole = cm.footprint(Forward(tokens, seq, routed), cm.full_recompute(), options).needed_bytes
    at_whole = plan_micro_batch(cm, whole, tokens, routed, seq, strategies, options)
    assert at_whole.activation_bytes + at_whole.room_bytes <= whole
    with pytest.raises(InfeasibleBudget):  # without recompute nothing gets there
        plan_micro_batch(cm, whole, tokens, routed, seq, ("offload", "fp8"), options)
    roomy = plan_micro_batch(cm, 2 * whole, tokens, routed, seq, strategies, options)
    assert dict(roomy.plan) != cm.full_recompute() and roomy.activation_bytes + roomy.room_bytes <= 2 * whole
    assert stage.min_budget < whole
    with pytest.raises(InfeasibleBudget) as below:
        plan_micro_batch(cm, stage.min_budget, tokens, routed, seq, strategies, options)
    best = below.value.best
    assert best.activation_bytes + best.room_bytes <= whole
