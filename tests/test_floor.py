"""The floor (paper §V-A, Algorithm 1's M0): on every Table II preset at 4K, 8K and 16K tokens
per sequence, the plan BaGuaLu runs at the smallest budget Algorithm 1 gives (M0), once its gates
have seen the routing, keeps no more than the strongest static policy the simulator knows, full
recompute with the all-to-alls (`CostModel.full_recompute(collective=True)`), and fits M0: at the
normal band's top and at `spike_max_imbalance`. Under expert parallelism that needs the gates'
collective escalation: a rank alone cannot recompute the all-to-alls, so its experts would hold
the rows dispatch received, which grow with the spike."""

from __future__ import annotations

import math

import pytest

from bagualu_plugin import load_recipe
from bagualu_plugin.costmodel import Forward
from bagualu_plugin.planner.decider import Decider, Decisions
from bagualu_plugin.planner.gate import plan_for_gates
from bagualu_plugin.stage import Stage

PRESETS = (
    "glm-188b-a20b", "glm-319b-a30b", "glm-423b-a30b", "glm-629b-a30b", "glm-783b-a35b", "glm-835b-a30b",
    "glm-1041b-a35b-8192", "glm-1041b-a35b-12288",
)


def _stages(preset: str, seq_len: int):
    recipe = load_recipe(preset)
    recipe = recipe.model_copy(update={"batch": recipe.batch.model_copy(update={"seq_len": seq_len})})
    last = recipe.pipeline.pp - 1
    for rank in (0, last):  # the most forwards in flight; the LM head
        pipe = recipe.pipeline.model_copy(update={"rank": rank})
        yield rank, Stage.of(recipe.model_copy(update={"pipeline": pipe}))


@pytest.mark.parametrize("seq_len", [4096, 8192, 16384])
@pytest.mark.parametrize("preset", PRESETS)
def test_bagualu_at_m0_keeps_no_more_than_full_recompute(preset, seq_len):
    for rank, stage in _stages(preset, seq_len):
        spikes = stage.recipe.spikes
        decider = Decider(stage, dict(enumerate(stage.chunks)))
        for c, cm in decider.costs.items():
            band = decider.band(c, stage.tokens, seq_len)
            whole = cm.full_recompute(collective=True)
            for imbalance in (spikes.normal_max_imbalance, spikes.spike_max_imbalance):
                gates, slack = plan_for_gates(band.plan, stage.min_budget, band.planned, band.heaviest)
                f = Decisions(0, stage.min_budget, gates, gates.decision.plan, slack, 0.0, band.balanced)
                for layer in cm.moe_layers:
                    decider.at_gate(f, layer, band.balanced * imbalance)
                routed = band.balanced * imbalance
                runs = cm.footprint(Forward(stage.tokens, seq_len, routed), f.plan, stage.options)
                static = cm.footprint(Forward(stage.tokens, seq_len, routed), whole, stage.options)
                where = f"{preset} at {seq_len}, rank {rank} chunk {c}, routing {imbalance}x"
                assert runs.device_bytes <= static.device_bytes, where
                assert runs.needed_bytes <= stage.min_budget, where


def test_a_layout_the_floor_cannot_hold_is_refused_before_training_with_what_would_fit():
    """glm-423b-a30b on a 24 GiB device: its 23 in-flight chunk forwards do not fit even at M0.
    `Stage.budgets` (what `bgl.apply`, `bagualu validate-recipe` and the nanotron config check
    start Algorithm 1 with) names the rank, the bytes and the capacity, and what would fit, each
    of which does."""
    recipe = load_recipe("glm-423b-a30b")
    recipe = recipe.model_copy(update={"hardware": recipe.hardware.model_copy(update={"capacity_bytes": 24 << 30})})
    stage = Stage.of(recipe)
    with pytest.raises(ValueError) as refused:
        stage.budgets()
    text = str(refused.value)
    for part in ("pipeline rank 0 of 8", f"capacity {stage.capacity} bytes", f"static memory {stage.static_bytes}",
                 f"23 in-flight micro-batches at the minimum M0 = {stage.min_budget} bytes"):
        assert part in text, (part, text)
    assert "would fit: batch.seq_len 2048" in text and "or pipeline.pp 16" in text, text
    shorter = recipe.model_copy(update={"batch": recipe.batch.model_copy(update={"seq_len": 2048})})
    Stage.of(shorter).budgets()
    for rank in range(16):
        pipe = recipe.pipeline.model_copy(update={"pp": 16, "rank": rank})
        Stage.of(recipe.model_copy(update={"pipeline": pipe})).budgets()


def test_without_recompute_the_floor_is_the_least_the_allowed_strategies_keep():
    """With recompute not allowed no plan reaches full recompute: M0 is what Algorithm 2's path
    over the allowed strategies ends at, with every gate escalated (gates recompute the experts
    whatever the strategies), and the room to bring offloaded copies back. A capacity under it is
    refused before training: planning below it plans what cannot fit (a TRL run with offload only
    once died of it at its first micro-batch). On one device routing never spikes."""
    import bagualu_plugin as bgl
    from bagualu_plugin.adapters import tiny_model
    from bagualu_plugin.costmodel.graph import EXPERT_OPS
    from bagualu_plugin.planner.gate import escalated
    from bagualu_plugin.planner.greedy import InfeasibleBudget, plan_micro_batch

    model = tiny_model("glm4_moe", num_hidden_layers=3)
    partial = {"hardware": {"capacity_bytes": "1GiB"}, "budget": {"non_activation_bytes": 0},
               "batch": {"micro_batch_size": 2, "seq_len": 16}}
    full = Stage.of(bgl.derive_recipe(model, partial))
    only = bgl.derive_recipe(model, {**partial, "strategies": {"allowed": ["offload", "fp8"]}})
    stage = Stage.of(only)
    cm, tokens = stage.cost, only.batch.tokens
    pairs = [tokens * cm.pairs_per_token] * len(cm.moe_layers)  # balanced: the most one device sees
    with pytest.raises(InfeasibleBudget) as infeasible:
        plan_micro_batch(cm, 0, tokens, pairs, 16, ["offload", "fp8"], stage.options)
    plan = infeasible.value.best.plan
    for layer in cm.moe_layers:
        plan = escalated(plan, layer, EXPERT_OPS)
    assert stage.min_budget == math.ceil(cm.footprint(Forward(tokens, 16, pairs), plan, stage.options).needed_bytes) > full.min_budget
    capacity = stage.min_budget - 1
    with pytest.raises(ValueError, match=rf"capacity {capacity} bytes cannot hold static memory 0 plus 1 in-flight micro-batches "
                                         rf"at the minimum M0 = {stage.min_budget} bytes \(1 bytes short; M0 is the least a forward "
                                         "of offload, fp8 mitigation keeps"):
        bgl.apply(model, {**partial, "hardware": {"capacity_bytes": capacity}, "strategies": {"allowed": ["offload", "fp8"]}})
