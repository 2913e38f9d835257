"""The Provisioner on a real (tiny) model: a 1F1B stage iteration under a simulated capacity."""

import json
import pytest
import torch

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.config import Recipe
from bagualu_plugin.costmodel import ModelDims
from bagualu_plugin.runtime import Ledger, SimulatedOutOfMemoryError
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.runtime.provisioner import apply, run_stage

PP, RANK, M, BATCH, SEQ = 4, 0, 6, 2, 32


def _recipe(model, capacity: int) -> Recipe:
    dims = ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa")
    return Recipe.from_dict(
        {
            "hardware": {"preset": "cpu", "capacity_bytes": capacity},
            "model": dims.model_dump(),
            "pipeline": {"pp": PP, "rank": RANK, "micro_batches": M},
            "batch": {"seq_len": SEQ, "micro_batch_size": BATCH},
            "budget": {"non_activation_bytes": 0},
        }
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
        actuals = run_stage(prov, model, _batches(), PP, RANK)
        lines = [json.loads(line) for line in telemetry.read_text().splitlines()]  # one per micro-batch
        assert sorted(e["micro_batch"] for e in lines) == list(range(M))  # written in backward order
        fields = {"phase", "budget", "predicted", "actual", "plan", "escalations", "deferred", "planner_s", "live_after_backward"}
        assert all(fields <= set(e) for e in lines)
        with pytest.raises(ValueError, match="no finished forward"):
            prov.end_backward(0)
        assert prov.ledger.peak_device_bytes <= capacity
        assert all(e["actual"] <= e["budget"] for e in prov.events)
        assert any(e["plan"] for e in prov.events)  # it had to mitigate
        assert [e["actual"] for e in prov.events] == actuals
        # 1F1B on rank 0 of 4: F0 F1 F2 F3 B0 ...: after B0 the stage keeps micro-batches 1-3
        assert prov.events[0]["live_after_backward"] == sum(actuals[1:4])
        # budgets were re-based on actuals: the steady budget of micro-batch 4 is what micro-batch 0 freed
        assert prov.events[4]["budget"] == capacity - (sum(actuals[:4]) - actuals[0])
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


def test_budget_below_m0_fails_before_training_with_numbers():
    model = tiny_model("glm4_moe", num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"cannot hold static memory 0 plus 4 in-flight micro-batches at the full-recompute minimum M0"):
        apply(model, _recipe(model, 1000), model_cost(model))


def test_gate_escalates_exactly_the_spiking_layer_and_defers_in_warmup():
    from bagualu_plugin.adapters import Adapter
    from bagualu_plugin.adapters.experts import set_expert_parallel
    from bagualu_plugin.adapters.gate import RoutingSkew
    from bagualu_plugin.costmodel.pipeline import one_f_one_b
    from bagualu_plugin.runtime.profiler import profile

    model = tiny_model("glm4_moe", num_hidden_layers=4)
    cm = profile(model, [32, 64, 128], ep_size=4, ep_rank=0, repeats=1)  # rank 0 of 4 emulated
    adapter = Adapter(model)
    set_expert_parallel(adapter, 4, 0)
    recipe = _recipe(model, int(2.5 * cm.activation_bytes(BATCH * SEQ, seq_len=SEQ)))
    recipe = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"dp": 4, "ep": 4})})
    prov = apply(model, recipe, cm)
    losses = {}
    spiking = (1, 4)  # a warmup and a steady micro-batch
    try:
        for step in one_f_one_b(PP, RANK, M):
            ids = _batches()[step.micro_batch]
            if step.kind == "B":
                losses.pop(step.micro_batch).backward()
                continue
            prov.begin_forward(step.micro_batch, ids.numel(), SEQ)
            # the spiking micro-batches route every pair of layer 2 to this rank's experts (a 4x
            # spike); the others route through the same (no-op) hook so they save the same tensors
            fraction = 1.0 if step.micro_batch in spiking else 0.0
            with RoutingSkew(adapter, fraction, ep_size=4, ep_rank=0, layers=[2]):
                losses[step.micro_batch] = model(input_ids=ids, labels=ids).loss
            prov.end_forward(step.micro_batch)
        events = {e["micro_batch"]: e for e in prov.events}
        # warmup: the later warmup micro-batches give up what the spike needs (Algorithm 1 re-bases)
        assert 2 in [x["layer"] for x in events[1]["deferred"]] and not events[1]["escalations"]
        assert events[1]["actual"] > events[1]["budget"]
        # steady: the budget is all the free memory, so the spiking layer's experts recompute
        spike = [x for x in events[4]["escalations"] if x["layer"] == 2]
        assert spike and spike[0]["local_pairs"] == BATCH * SEQ * 2  # every (token, slot) pair landed here
        assert events[4]["actual"] <= events[4]["budget"]
        planned = BATCH * SEQ * 2 / 4 * recipe.spikes.normal_max_imbalance
        # a random-init router is skewed too: any other escalation is one that really overran
        others = [x for e in prov.events for x in e["escalations"] + e["deferred"]]
        assert all(x["local_pairs"] > planned and x["overrun"] > 0 for x in others)
        assert prov.ledger.peak_device_bytes <= recipe.hardware.capacity_bytes
    finally:
        prov.remove()
        set_expert_parallel(adapter, 1, 0)


def test_engine_phase_and_in_flight_are_checked():
    model = tiny_model("glm4_moe", num_hidden_layers=4)
    cm = model_cost(model)
    prov = apply(model, _recipe(model, int(2.5 * cm.activation_bytes(BATCH * SEQ, seq_len=SEQ))), cm)
    try:
        with pytest.raises(ValueError, match=r"begin_forward\(0\): the engine says phase='steady'.*expects 'warmup'"):
            prov.begin_forward(0, BATCH * SEQ, SEQ, phase="steady")
        with pytest.raises(ValueError, match=r"in_flight=2.*expects 0.*end_backward"):
            prov.begin_forward(0, BATCH * SEQ, SEQ, in_flight=2)
    finally:
        prov.remove()
