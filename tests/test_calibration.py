"""The cost model checked against the Ledger while training (`runtime.calibration`): an op that
saves a tensor its cost model does not know (what a new transformers release does) is named once,
never becomes an out-of-memory error while the floor fits, and the next micro-batches are planned
on what it kept."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import bagualu_plugin as bgl
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.costmodel import ForwardKind
from bagualu_plugin.runtime import calibration

BATCH, SEQ, MICRO_BATCHES, STEPS = 2, 32, 2, 3
EXACT = {"allowed": ["recompute", "offload"]}


COPIES = 8


def _saving_more(forward, copies: int = COPIES):
    """`forward`, now also saving a storage of `copies` times its output's size (exp saves its
    result), as a release that changes the op would; the values are unchanged (output + 0)."""

    def more(*args, **kwargs):
        output = forward(*args, **kwargs)
        return output + output.expand(copies, *output.shape).exp().sum(0) * 0

    return more


@pytest.mark.parametrize("layer", [1, 3])  # 3: the last MoE layer, whose own gate is the only one after the op
def test_an_op_that_saves_more_than_its_cost_model_is_named_once_and_planned_for(layer):
    model = tiny_model("qwen3_moe", num_hidden_layers=4)
    norm = model.model.layers[layer].post_attention_layernorm  # op <layer>.mlp_norm, before the layer's gate
    cm = model_cost(model)
    capacity = int(0.6 * cm.activation_bytes(BATCH * SEQ, seq_len=SEQ))  # activations only: no static bytes counted
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": capacity}, "budget": {"non_activation_bytes": 0}, "strategies": EXACT,
                             "pipeline": {"micro_batches": MICRO_BATCHES}})
    norm.forward = _saving_more(norm.forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                for _ in range(MICRO_BATCHES):
                    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
                    (model(input_ids=ids, labels=ids.clone()).loss / MICRO_BATCHES).backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        del norm.forward
        prov.remove()
    events = list(prov.events)
    assert len(events) == STEPS * MICRO_BATCHES and any(e.plan for e in events)
    # no out-of-memory error, the first micro-batch's included: the gates from the op's own on took
    # what it kept beyond its prediction from their slack (without that, this capacity runs out in it)
    assert prov.peak_device_bytes <= capacity
    assert any(x.layer == layer for x in events[0].escalations)
    named = [str(w.message) for w in caught if "kept" in str(w.message) and "cost model" in str(w.message)]
    assert len(named) == 1 and f"op {layer}.mlp_norm of qwen3_moe kept" in named[0], named
    # the kind and the cause in words: the tested releases are not the cause here
    assert "(a plain forward over fp32 weights on cpu)" in named[0] and calibration._cause() in named[0]
    extra = COPIES * BATCH * SEQ * model.config.hidden_size * 4  # exp's output, float32
    first = events[0].misses
    assert [m.op for m in first] == [f"{layer}.mlp_norm"] and first[0].measured - first[0].predicted == extra
    assert all(e.misses == [] for e in events[1:])  # planned, and kept, on the bytes measured
    corrected = prov.decider.costs[ForwardKind()]
    assert corrected.activation_bytes(BATCH * SEQ, seq_len=SEQ) == cm.activation_bytes(BATCH * SEQ, seq_len=SEQ) + extra


def test_an_excess_saved_outside_the_ops_regions_is_planned_as_kept_whatever_the_plan():
    """A tensor saved after the last MoE layer's experts return (their module's forward wrapped
    from outside, where the experts' recompute regions do not reach) is charged to expert_fc2.
    Planned first as the op's own, it stays when a plan mitigates the op: the second correction
    keeps it whatever the plan, and from then on every micro-batch keeps what it predicts."""
    model = tiny_model("qwen3_moe", num_hidden_layers=4)
    experts = model.model.layers[3].mlp.experts
    cm = model_cost(model)
    capacity = int(0.7 * cm.activation_bytes(BATCH * SEQ, seq_len=SEQ))
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": capacity}, "budget": {"non_activation_bytes": 0}, "strategies": EXACT,
                             "pipeline": {"micro_batches": MICRO_BATCHES}})
    experts.forward = _saving_more(experts.forward, 1)
    g = torch.Generator().manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(STEPS):
                for _ in range(MICRO_BATCHES):
                    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
                    (model(input_ids=ids, labels=ids.clone()).loss / MICRO_BATCHES).backward()
    finally:
        del experts.forward
        prov.remove()
    events = list(prov.events)
    assert all(e.plan for e in events) and prov.peak_device_bytes <= capacity
    extra = BATCH * SEQ * model.config.hidden_size * 4
    assert [(m.op, m.measured - m.predicted) for m in events[0].misses] == [("3.expert_fc2", extra)]
    assert all(e.misses == [] for e in events[2:]), [e.misses for e in events]


def _experts_saving_more(model, copies: int) -> None:
    """The last MoE layer's experts, now also saving `copies` times their output's size (charged
    to expert_fc2, after the layer's gate: the last decision point of a forward)."""
    experts = model.model.layers[-1].mlp.experts
    experts.forward = _saving_more(experts.forward, copies)


def _train(model) -> list[torch.Tensor]:
    g, losses = torch.Generator().manual_seed(0), []
    for _ in range(STEPS):
        for _ in range(MICRO_BATCHES):
            ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
            loss = model(input_ids=ids, labels=ids.clone()).loss / MICRO_BATCHES
            loss.backward()
            losses.append(loss.detach())
    return losses


@pytest.mark.parametrize(("copies", "fraction"), [(8, 0.4), (4, 0.6)])
def test_an_excess_after_the_last_gate_moves_kept_activations_to_the_host_and_stays_exact(copies, fraction):
    """No gate is left to take the excess from its slack: the save that would run out of memory
    first moves activations kept earlier to host memory (`Ledger.spill_at`). No out-of-memory
    error, losses and gradients bitwise those of the same model without the plugin, one warning,
    and planned for from then on, with recompute the only strategy plans may use too. Without the
    move the same run runs out of memory."""
    model = tiny_model("qwen3_moe", num_hidden_layers=4)
    plain = copy.deepcopy(model)
    _experts_saving_more(plain, copies)
    reference = _train(plain)
    capacity = int(fraction * model_cost(model).activation_bytes(BATCH * SEQ, seq_len=SEQ))
    recipe = {"hardware": {"capacity_bytes": capacity}, "budget": {"non_activation_bytes": 0}, "strategies": EXACT,
              "pipeline": {"micro_batches": MICRO_BATCHES}}
    prov = bgl.apply(model, recipe)
    _experts_saving_more(model, copies)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = _train(model)
    finally:
        prov.remove()
    assert all(map(torch.equal, losses, reference))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()) if q.grad is not None)
    events = list(prov.events)
    assert prov.peak_device_bytes <= capacity and events[0].spilled_bytes > 0
    assert all(e.spilled_bytes == 0 for e in events[2:]), [e.spilled_bytes for e in events]
    assert prov.ledger.live_host_bytes == 0  # every copy came back, or went with its graph
    moved = [str(w.message) for w in caught if "moved to host memory" in str(w.message)]
    assert len(moved) == 1 and "micro-batch 0" in moved[0], moved

    for spill in (True, False):
        model = tiny_model("qwen3_moe", num_hidden_layers=4)
        prov = bgl.apply(model, {**recipe, "strategies": {"allowed": ["recompute"]}})
        if not spill:
            prov.ledger.spill_at = None
        _experts_saving_more(model, copies)
        try:
            with warnings.catch_warnings(), contextlib.nullcontext() if spill else pytest.raises(torch.OutOfMemoryError):
                warnings.simplefilter("ignore")
                _train(model)
        finally:
            prov.remove()
        assert not spill or (prov.peak_device_bytes <= capacity and prov.events[0].spilled_bytes > 0)


def _sliced_loop(lora: bool) -> tuple[list, int, int]:
    """A plain loop over micro-batches sliced from one batch tensor (`for ids in batch`), at a
    capacity that forces plans, every bagualu warning an error: (events, peak, capacity)."""
    model = tiny_model("qwen3_moe", num_hidden_layers=3)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cm = model_cost(model)
    capacity = int(0.6 * cm.activation_bytes(BATCH * SEQ, seq_len=SEQ))
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": capacity}, "budget": {"non_activation_bytes": 0}, "strategies": EXACT,
                             "pipeline": {"micro_batches": MICRO_BATCHES}})
    batch = torch.randint(0, 128, (MICRO_BATCHES, BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="bagualu", category=RuntimeWarning)
            for ids in batch:  # views: each keeps the whole batch's storage
                model(input_ids=ids, labels=ids).loss.backward()
    finally:
        prov.remove()
    return list(prov.events), prov.peak_device_bytes, capacity


def test_micro_batches_sliced_from_one_tensor_are_planned_with_the_whole_tensor_their_ids_keep():
    events, peak, capacity = _sliced_loop(lora=False)
    whole = MICRO_BATCHES * BATCH * SEQ * 8  # the batch's int64 ids, which the embedding's saved view keeps
    assert [e.ids_view_bytes for e in events] == [whole - BATCH * SEQ * 8] * MICRO_BATCHES
    assert any(e.plan for e in events) and all(e.misses == [] for e in events)  # priced, not a cost-model miss
    assert peak <= capacity


def test_a_frozen_embedding_keeps_no_ids_so_a_sliced_micro_batch_keeps_nothing_more():
    events, peak, capacity = _sliced_loop(lora=True)
    assert [e.ids_view_bytes for e in events] == [0] * MICRO_BATCHES
    assert all(e.misses == [] for e in events) and peak <= capacity


def test_a_held_graph_of_an_abandoned_forward_is_no_later_micro_batchs():
    """A forward whose output never goes backward, kept by the caller: its saves stay counted (as
    held memory), not as the next micro-batch's of the same index, which would otherwise be
    reported as a miss and its cost model 'corrected' to twice its size."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    cm = model_cost(model)
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": 10**9}, "budget": {"non_activation_bytes": 0}})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="bagualu", category=RuntimeWarning)
            ids = torch.randint(0, 128, (BATCH, SEQ))
            held = model(input_ids=ids, labels=ids.clone())  # abandoned at the next forward, kept alive here
            ids = torch.randint(0, 128, (BATCH, SEQ))
            model(input_ids=ids, labels=ids.clone()).loss.backward()
    finally:
        prov.remove()
    (event,) = prov.events
    assert event.misses == [] and event.actual == cm.activation_bytes(BATCH * SEQ, seq_len=SEQ)
    assert prov.decider.costs[ForwardKind()].activation_bytes(BATCH * SEQ, seq_len=SEQ) == event.actual  # not 'corrected'
    assert prov.ledger.live_device_bytes > 0  # the held graph, still counted
    del held


def test_a_miss_outside_the_tested_releases_names_the_release(monkeypatch):
    from bagualu_plugin import versions

    monkeypatch.setattr(versions, "untested", lambda: ["transformers 9.1.0 (tested: 5.24.0 to 5.25.0)", "nanotron 0.5"])
    assert calibration._cause() == (
        "Cause: transformers 9.1.0 (tested: 5.24.0 to 5.25.0), a release that may save other tensors than the cost model describes"
    )


def test_a_loop_that_computes_its_own_loss_on_the_logits_is_a_kind_of_its_own_and_exact():
    """No labels: the model computes no loss (`ForwardKind.loss`), so its head keeps nothing beyond
    the logits it returns; the caller's loss runs after the forward. Planned, with no miss."""
    model = tiny_model("qwen3_moe", num_hidden_layers=3)
    capacity = int(0.6 * model_cost(model, kind=ForwardKind(loss=False)).activation_bytes(BATCH * SEQ, seq_len=SEQ))
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": capacity}, "budget": {"non_activation_bytes": 0}, "strategies": EXACT,
                             "pipeline": {"micro_batches": 1}})
    g = torch.Generator().manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="bagualu", category=RuntimeWarning)
            for seq in (SEQ, SEQ - 5, SEQ + 3):
                ids = torch.randint(0, 128, (BATCH, seq), generator=g)
                logits = model(input_ids=ids).logits
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    finally:
        prov.remove()
    assert all(e.plan and e.misses == [] and e.kind["loss"] is False for e in prov.events)


def test_a_miss_that_recurs_in_every_micro_batch_of_a_kind_is_reported_once_as_a_failure():
    """An op that saves a fixed number of bytes whatever the shape: planning on the bytes per token
    it kept cannot make the next micro-batches of another length exact, and after `UNCONVERGED` in a
    row the check says so, once, naming the kind."""
    from bagualu_plugin.runtime.calibration import UNCONVERGED

    model = tiny_model("qwen3_moe", num_hidden_layers=3)
    norm = model.model.layers[1].post_attention_layernorm
    forward = norm.forward
    norm.forward = lambda x: forward(x) + torch.ones(1000, requires_grad=True).exp().sum() * 0  # exp keeps 4,000 bytes
    recipe = {"hardware": {"capacity_bytes": 10**9}, "budget": {"non_activation_bytes": 0}, "pipeline": {"micro_batches": 1}}
    prov = bgl.apply(model, recipe)
    g = torch.Generator().manual_seed(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seq in (SEQ, SEQ // 2, SEQ * 2, SEQ - 3, SEQ + 5, SEQ // 3):
                ids = torch.randint(0, 128, (BATCH, seq), generator=g)
                model(input_ids=ids, labels=ids.clone()).loss.backward()
    finally:
        del norm.forward
        prov.remove()
    assert all(e.misses for e in prov.events)
    failures = [str(w.message) for w in caught if "did not converge" in str(w.message)]
    assert len(failures) == 1 and f"the last {UNCONVERGED} micro-batches" in failures[0], failures
    assert "(a plain forward over fp32 weights on cpu)" in failures[0]
    assert prov.calibration.failed == {ForwardKind()}
