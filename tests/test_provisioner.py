"""The Provisioner on a real (tiny) model: a 1F1B stage iteration under a simulated capacity; the
stage numbers it budgets with; the gate-time decision, worked by hand."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers import tiny_recipe

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.config import Recipe, load_recipe
from bagualu_plugin.costmodel import Forward, ForwardKind, ModelDims, OpId
from bagualu_plugin.planner import GateDecision, at_gate
from bagualu_plugin.runtime import Ledger, SimulatedOutOfMemoryError
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.runtime.provisioner import apply
from bagualu_plugin.sim import read_trace
from bagualu_plugin.sim.trace import bucket
from bagualu_plugin.stage import Stage

PP, RANK, M, BATCH, SEQ = 4, 0, 6, 2, 32


def _recipe(model, capacity: int) -> Recipe:
    """Capacity in bytes."""
    return tiny_recipe(
        model, seq_len=SEQ, micro_batch_size=BATCH, capacity_bytes=capacity, pipeline={"pp": PP, "rank": RANK, "micro_batches": M},
    )


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(M)]


def test_adaptive_stage_fits_where_unmitigated_runs_out_of_memory(tmp_path):
    model = tiny_model("glm4_moe", num_hidden_layers=4)
    cm = model_cost(model)
    keep = cm.activation_bytes(BATCH * SEQ, seq_len=SEQ)
    capacity = int(2.5 * keep)  # rank 0 of 4 holds 4 micro-batches at its peak
    recipe = _recipe(model, capacity)
    telemetry = tmp_path / "events.jsonl"
    prov = apply(model, recipe.model_copy(update={"telemetry": recipe.telemetry.model_copy(update={"path": str(telemetry)})}), cm)
    try:
        run_iteration(model, _batches(), prov.stage.schedule, prov)
        lines = [json.loads(line) for line in telemetry.read_text().splitlines()]  # one per micro-batch
        assert [e["micro_batch"] for e in lines] == [0, 1, 2, 3, 4, 5]  # written in backward order
        fields = [
            "micro_batch", "phase", "budget", "predicted", "plan", "escalations", "deferred", "tokens", "seq_len",
            "room_bytes", "planner_s", "capacity", "forward", "mitigation_s", "mitigated", "actual", "peak_device_bytes",
            "device_bytes", "live_after_backward", "point", "routed", "balanced_pairs", "kind", "misses", "ids_view_bytes",
            "varlen_bytes", "spilled_bytes",
        ]
        assert all(list(e) == fields for e in lines)
        assert all(e["capacity"] == capacity for e in lines) and sorted(e["forward"] for e in lines) == list(range(6))
        # what each plan took off, at the routing its gates saw: what nothing mitigated keeps beyond what the plan keeps
        assert any(e["plan"] for e in lines)
        for e in lines:
            routed, plan = list(e["routed"].values()), {OpId.parse(op): s for op, s in e["plan"].items()}
            taken = cm.activation_bytes(BATCH * SEQ, routed, SEQ) - cm.activation_bytes(BATCH * SEQ, routed, SEQ, plan)
            assert sum(e["mitigated"].values()) == pytest.approx(taken) and (e["mitigation_s"] > 0) == bool(plan)
        assert all(e["misses"] == [] and e["spilled_bytes"] == 0 for e in lines)  # every op kept what the cost model predicts
        # the routing each MoE gate saw (what `bagualu simulate --trace` replays)
        assert all(list(e["routed"]) == [str(layer) for layer in cm.moe_layers] and all(e["routed"].values()) for e in lines)
        assert all(e["balanced_pairs"] == BATCH * SEQ * cm.pairs_per_token for e in lines)
        trace = read_trace(telemetry, load_recipe("glm-423b-a30b"), 1)  # replayed on a preset, tiled
        first = [lines[0]["routed"][str(layer)] / lines[0]["balanced_pairs"] for layer in cm.moe_layers]
        assert trace.imbalance[0][0][: len(first)] == pytest.approx([bucket(x) for x in first])
        assert lines == [json.loads(e.to_json()) for e in prov.events]
        with pytest.raises(ValueError, match="no finished forward"):
            prov.end_backward(0)
        assert prov.ledger.peak_device_bytes <= capacity
        assert all(e.actual <= e.budget for e in prov.events)
        assert any(e.plan for e in prov.events)  # it had to mitigate
        actuals = [e.actual for e in prov.events]
        # 1F1B on rank 0 of 4: F0 F1 F2 F3 B0 ...: after B0 the stage keeps micro-batches 1-3
        assert prov.events[0].live_after_backward == sum(actuals[1:4])
        # budgets were re-based on actuals: the steady budget of micro-batch 4 is what micro-batch 0 freed
        assert prov.events[4].budget == capacity - (sum(actuals[:4]) - actuals[0])
    finally:
        prov.remove()
    # the same capacity with nothing mitigated overruns at the 3rd warmup forward, as on a GPU
    ledger = Ledger.for_model(model, capacity_bytes=capacity)
    losses = []
    with pytest.raises(SimulatedOutOfMemoryError, match="simulated out of memory"):
        with ledger.track():
            for ids in _batches():
                losses.append(model(input_ids=ids, labels=ids).loss)
    assert len(losses) == 2


def test_the_telemetry_is_on_by_default_and_a_switch_or_an_unwritable_place_turns_it_off(tmp_path):
    """Without a path the events go to the working directory (the test's own), one file per rank
    where several write, begun anew by each run, each line on disk before the run ends; `enabled:
    false` writes none; a place that cannot be written is said once and the run goes on with its
    events in memory."""
    from bagualu_plugin.config import Telemetry

    assert Telemetry().file() == Path("bagualu-telemetry.jsonl")
    assert Telemetry(path="out/events.jsonl").file(rank=3, world=4) == Path("out/events.rank3.jsonl")
    assert Telemetry(enabled=False).file() is None
    model = tiny_model("glm4_moe", num_hidden_layers=4)
    recipe = _recipe(model, 10 * model_cost(model).activation_bytes(BATCH * SEQ, seq_len=SEQ))
    (tmp_path / "bagualu-telemetry.jsonl").write_text("an earlier run's line\n")
    for telemetry, lines in (({}, M), ({"enabled": False}, None), ({"path": str(tmp_path / "a-file" / "events.jsonl")}, None)):
        (tmp_path / "a-file").write_text("")  # a file where the path needs a directory
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            prov = apply(model, recipe.model_copy(update={"telemetry": Telemetry(**telemetry)}))
            run_iteration(model, _batches(), prov.stage.schedule, prov)
            if lines is not None:  # each line on disk as its micro-batch completes: a job that dies keeps them
                assert len((tmp_path / "bagualu-telemetry.jsonl").read_text().splitlines()) == lines
            prov.remove()
        lost = [str(w.message) for w in said if "cannot write the telemetry" in str(w.message)]
        assert len(lost) == (1 if "path" in telemetry else 0) and len(prov.events) == M
        if lines is not None:
            assert len((tmp_path / "bagualu-telemetry.jsonl").read_text().splitlines()) == lines


def test_budget_below_m0_fails_before_training_with_numbers():
    model = tiny_model("glm4_moe", num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"cannot hold static memory 0 plus 4 in-flight micro-batches at the minimum M0"):
        apply(model, _recipe(model, 1000), model_cost(model))


@pytest.mark.parametrize(
    "pairs, decision",
    [
        # planned 100 pairs at 2 bytes each, slack 50, headroom 30, escalation saves 70
        (110, GateDecision("fits", 0.0, 30.0, 30.0)),  # 10 extra pairs = 20 bytes, 50 - 20 = 30 left
        (90, GateDecision("fits", 0.0, 50.0, 30.0)),  # fewer than planned: the slack stays
        (125, GateDecision("fits", 0.0, 0.0, 30.0)),  # 25 pairs = 50 bytes: exactly the slack
        (140, GateDecision("defer", 30.0, 0.0, 0.0)),  # 80 bytes, 30 over the slack: all the headroom
        (141, GateDecision("escalate", 32.0, 120.0, 30.0)),  # 82 bytes, 32 over > 30; slack 50 + 70
    ],
)
def test_gate_decision_by_hand(pairs, decision):
    assert at_gate(pairs, planned=100, bytes_per_pair=2.0, escalation_bytes=-70.0, slack=50.0, headroom=30.0) == decision


@pytest.mark.parametrize(
    "pairs, decision",
    [
        # as above, but 20 of the 50 bytes of slack are the later layers' (reserve): 30 usable
        (115, GateDecision("fits", 0.0, 20.0, 30.0)),  # 30 bytes: exactly the usable slack
        (130, GateDecision("defer", 30.0, 20.0, 0.0)),  # 60 bytes, 30 over: the headroom; the reserve stays
        (131, GateDecision("escalate", 32.0, 120.0, 30.0)),
    ],
)
def test_gate_leaves_the_later_layers_reserve(pairs, decision):
    assert at_gate(pairs, 100, 2.0, -70.0, slack=50.0, headroom=30.0, reserve=20.0) == decision


def test_stage_owns_usable_capacity_warmup_and_schedule():
    model = tiny_model("glm4_moe", num_hidden_layers=4)
    recipe = _recipe(model, 10_000_000)
    recipe = recipe.model_copy(update={"budget": recipe.budget.model_copy(update={"reserve_bytes": 1_000_000})})
    stage = Stage.of(recipe, model_cost(model), split=False)
    assert stage.capacity == 9_000_000  # the reserve is never given to activations
    assert stage.warmup == 4  # rank 0 of 4: three warmup forwards and the first steady one stack
    assert [f"{s.kind}{s.micro_batch}" for s in stage.schedule][:6] == ["F0", "F1", "F2", "F3", "B0", "F4"]
    last = recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"rank": 3})})
    assert Stage.of(last, model_cost(model), split=False).warmup == 1
    few = recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"micro_batches": 2})})
    assert Stage.of(few, model_cost(model), split=False).warmup == 2
    prov = apply(model, recipe, model_cost(model))
    try:  # the Provisioner budgets and limits the simulated device with the stage's numbers
        assert (prov.decider.budgets.capacity, prov.decider.budgets.warmup) == (9_000_000, 4)
        assert prov.ledger.capacity_bytes == 9_000_000
    finally:
        prov.remove()


def test_engine_phase_and_in_flight_are_checked():
    model = tiny_model("glm4_moe", num_hidden_layers=4)
    cm = model_cost(model)
    prov = apply(model, _recipe(model, int(2.5 * cm.activation_bytes(BATCH * SEQ, seq_len=SEQ))), cm)
    try:
        with pytest.raises(ValueError, match=r"begin_forward\(0\): the engine says phase='steady'.*expects 'warmup'"):
            prov.begin_forward(0, Forward(BATCH * SEQ, SEQ), phase="steady")
        with pytest.raises(ValueError, match=r"in_flight=2.*expects 0.*end_backward"):
            prov.begin_forward(0, Forward(BATCH * SEQ, SEQ), in_flight=2)
        with pytest.raises(ValueError, match=r"end_forward\(0\): no forward of micro-batch 0 is running"):
            prov.end_forward(0)
        with pytest.raises(ValueError, match=r"begin_forward\(0\): forward.routed is known.*foresee\(0, forward\)"):
            prov.begin_forward(0, Forward(BATCH * SEQ, SEQ, 5))
        with pytest.raises(ValueError, match=r"foresee\(0\): forward.routed is None"):
            prov.foresee(0, Forward(BATCH * SEQ, SEQ))
        with pytest.raises(ValueError, match=r"routed has 1 entries, expected one per MoE layer"):
            prov.foresee(0, Forward(BATCH * SEQ, SEQ, [5]))
        ids = _batches()[0]
        prov.begin_forward(0, Forward(BATCH * SEQ, SEQ))
        with pytest.raises(ValueError, match=r"begin_forward\(1\): the forward of micro-batch 0 has not ended"):
            prov.begin_forward(1, Forward(BATCH * SEQ, SEQ))
        model(input_ids=ids, labels=ids).loss.backward()
        prov.end_forward(0)
        # a new iteration with micro-batch 0 still awaiting its end_backward: the state is not empty
        with pytest.raises(ValueError, match=r"begin_forward\(0\): micro-batches \[0\] of the last iteration await end_backward"):
            prov.begin_forward(0, Forward(BATCH * SEQ, SEQ))
        prov.end_backward(0)
    finally:
        prov.remove()


def test_default_cost_model_prices_mitigation_on_the_recipe_s_hardware():
    """`bgl.apply(model, recipe)` without `cost=`: the analytic model of the model's config on the
    recipe's hardware (an H100's rooflines, not this CPU's), as `CostModel.from_config` builds it."""
    from bagualu_plugin.costmodel import CostModel, OpId

    model = tiny_model("glm4_moe", num_hidden_layers=4)
    recipe = Recipe.from_dict({**_recipe(model, 1).model_dump(), "hardware": "h100"})
    prov = apply(model, recipe)
    try:
        cm = prov.stage.cost
        assert cm.hardware.name == "h100" and cm.hardware == recipe.hardware
        dims = ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa")
        h100, cpu = CostModel.from_config(dims, "h100"), CostModel.from_config(dims, "cpu")
        op, tokens = OpId(1, "expert_fc1"), BATCH * SEQ
        priced = cm.mitigation_cost(op, "offload", Forward(tokens, SEQ))
        assert priced == h100.mitigation_cost(op, "offload", Forward(tokens, SEQ))
        assert priced.forward_s != cpu.mitigation_cost(op, "offload", Forward(tokens, SEQ)).forward_s
    finally:
        prov.remove()


def test_a_foreseen_micro_batch_is_planned_for_the_routing_it_brings():
    """The oracle's two passes: `routing` reads what each gate will see (no gradient, no plan),
    `foresee` plans the micro-batch for it; its forward then runs Algorithm 2's plan for that
    routing at its budget, never escalates, stays within its budget and trains bitwise as
    without the plugin."""
    model = tiny_model("glm4_moe", num_hidden_layers=4)
    cm = model_cost(model)
    recipe = tiny_recipe(
        model, seq_len=SEQ, micro_batch_size=BATCH, capacity_bytes=int(2.5 * cm.activation_bytes(BATCH * SEQ, seq_len=SEQ)),
        pipeline={"pp": PP, "rank": RANK, "micro_batches": M}, strategies={"allowed": ["recompute", "offload"]},
    )
    batches = _batches()

    def grads():
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    run_iteration(model, batches, Stage.of(recipe, cm, split=False).schedule)
    stock = grads()
    model.zero_grad(set_to_none=True)
    prov = apply(model, recipe, cm)
    try:
        run_iteration(model, batches, prov.stage.schedule, prov)
        seen = [e.routed for e in prov.events]
        model.zero_grad(set_to_none=True)
        routing = [prov.routing(model, input_ids=ids) for ids in batches]
        assert routing == seen and prov.ledger.live_device_bytes == 0  # the first pass keeps nothing
        for mb, ids in enumerate(batches):
            prov.foresee(mb, Forward(ids.numel(), SEQ, routing[mb]))
        run_iteration(model, batches, prov.stage.schedule, prov)
        foreseen = list(prov.events)[M:]
        for e in foreseen:
            want = prov.decider.foresee(e.tokens, SEQ, routing[e.micro_batch], ForwardKind()).plan(e.budget)[0].decision
            assert e.plan == want.plan.named() and e.predicted == want.activation_bytes
            assert not e.escalations and not e.deferred and e.actual <= e.budget
        assert any(e.plan for e in foreseen)  # it had to mitigate
        assert all(torch.equal(a, b) for a, b in zip(grads(), stock, strict=True))
        prov.foresee(0, Forward(BATCH * SEQ, SEQ, routing[0]))
        with pytest.raises(ValueError, match=r"begin_forward\(0\): foreseen for 64 tokens of length 32"):
            prov.begin_forward(0, Forward(BATCH * SEQ // 2, SEQ // 2))
    finally:
        prov.remove()
