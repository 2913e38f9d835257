"""Micro-batch boundaries found by the plugin (`runtime.boundaries`): a plain torch loop and a
plain Accelerate loop with only `bgl.apply(model, {"hardware": {"capacity_bytes": ...}})` added
train bitwise as without it, under a capacity the unplanned run exceeds; evaluation, `generate`,
a forward that never goes backward and a step that raises leave nothing behind; PEFT's nested
forward counts once; a larger micro-batch than any before is checked against the capacity; the
optimizer's state re-bases the budget at its first step; a model never put in training mode
(`from_pretrained` returns it in eval mode) is provisioned all the same."""

from __future__ import annotations

import pytest
import torch

import bagualu_plugin as bgl
from bagualu_plugin.adapters import save_tiny, tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.costmodel import Forward, ForwardKind
from bagualu_plugin.runtime import Ledger
from bagualu_plugin.runtime.replay import same, top_hooks
from bagualu_plugin.runtime.static_memory import storage_bytes

BATCH, SEQ, M, STEPS = 2, 32, 4, 2
EXACT = {"allowed": ["recompute", "offload"]}  # fp8 is lossy by design


def _model():
    return tiny_model("qwen3_moe", num_hidden_layers=4)


def _adam_state(model) -> int:
    """What AdamW keeps per parameter once it has stepped: exp_avg, exp_avg_sq and the step."""
    params = list(model.parameters())
    return 2 * storage_bytes(params) + 4 * len(params)


def _static(model) -> int:
    """Weights and buffers, gradients and Adam state."""
    return storage_bytes([*model.parameters(), *model.buffers()]) + storage_bytes(model.parameters()) + _adam_state(model)


def _capacity(model, share: float = 0.7) -> int:
    """The static bytes plus `share` of one unplanned micro-batch."""
    return _static(model) + int(share * model_cost(model).activation_bytes(BATCH * SEQ, seq_len=SEQ))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(M)] for _ in range(STEPS)]


def _train(model, between=None):
    """A plain loop: M micro-batches of gradient accumulation per AdamW step; `between()` after
    each step (evaluation, generate). Returns the losses and the final weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in _batches():
        for ids in step:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / M).backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        if between:
            between()
    return losses, [p.detach().clone() for p in model.parameters()]


def _same(ours, theirs):
    assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0]))
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))


def test_a_plain_loop_trains_bitwise_under_the_capacity():
    model = _model()
    capacity = _capacity(model)
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": capacity}, "strategies": EXACT})
    ours = _train(model)
    events = list(prov.events)
    prov.remove()
    stock = _model()
    ledger = Ledger.for_model(stock)
    with ledger.track():
        theirs = _train(stock)
    _same(ours, theirs)
    assert len(events) == STEPS * M and all(e.live_after_backward == 0 for e in events)
    assert any(e.plan for e in events) and prov.peak_device_bytes <= capacity
    assert _static(stock) + ledger.peak_device_bytes > capacity  # the stock loop would not fit
    assert prov.stage.static_bytes == _static(stock)  # re-based at the optimizer's first step


def test_a_model_never_put_in_training_mode_is_provisioned(tmp_path):
    """`from_pretrained` returns a model in eval mode; a loop that trains it without `train()`
    (grad enabled, backward, optimizer steps) still runs micro-batches, planned as any other."""
    from transformers import AutoModelForCausalLM

    save_tiny("qwen3_moe", tmp_path, num_hidden_layers=4)

    def load():
        return AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)

    model = load()
    assert not model.training
    capacity = _capacity(model)
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": capacity}, "strategies": EXACT})
    ours = _train(model)
    events = list(prov.events)
    prov.remove()
    _same(ours, _train(load()))
    assert len(events) == STEPS * M and any(e.plan for e in events) and prov.peak_device_bytes <= capacity


def test_the_optimizer_state_rebases_the_budget_at_its_first_step():
    model = _model()
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": _capacity(model)}, "strategies": EXACT})
    before = prov.stage.static_bytes
    assert before == _static(model) - _adam_state(model)  # weights and their gradients to come
    _train(model)
    budgets = [e.budget for e in prov.events]
    assert prov.stage.static_bytes - before == _adam_state(model)
    assert budgets[0] - budgets[M] == _adam_state(model)
    prov.remove()


def _between(model, prov=None, packs=None):
    """After a step: an evaluation forward and `generate` (neither planned, nothing packed), then
    a training-mode forward whose output never goes backward (planned, then dropped)."""

    def run():
        ids = _batches()[0][0]
        before, packed = (prov.forwards, len(packs)) if prov else (0, 0)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)
        model.train()
        model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
        if prov:
            assert (prov.forwards, len(packs), prov.running_kind) == (before, packed, None)
        model(input_ids=ids[:, :8]).logits.sum()
        if prov:
            assert prov.forwards == before + 1 and len(packs) > packed

    return run


def test_a_first_plan_that_recomputes_the_loss_is_in_force_in_its_own_forward():
    """The micro-batch's plan is set before the runtime's hooks read it: the loss runner arms for
    a plan that recomputes the LM head's loss even when the plan before it did not (here the
    first, planned for the routing a first pass recorded), so the logits are not kept."""
    model = _model()
    ids = _batches()[0][0]
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": 800_000}, "budget": {"non_activation_bytes": 0}, "strategies": EXACT,
                             "batch": {"seq_len": SEQ, "micro_batch_size": BATCH}, "pipeline": {"micro_batches": 1}})
    try:
        prov.foresee(0, Forward(ids.numel(), SEQ, prov.routing(model, input_ids=ids)))
        model(input_ids=ids, labels=ids).loss.backward()
        event = prov.events[-1]
        assert "4.loss" in event.plan and event.actual <= event.predicted  # 512 B under: the loss's label padding
    finally:
        prov.remove()


def test_evaluation_generate_and_forwards_without_backward_leave_no_trace():
    model = _model()
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": _capacity(model)}, "strategies": EXACT})
    packs = []
    for saves in (prov.runtime.hooks, prov.runtime.ledger):  # the plan's hooks, or the Ledger's where it stores nothing
        saves.pack = lambda t, pack=saves.pack: packs.append(1) or pack(t)
    ours = _train(model, _between(model, prov, packs))
    prov.remove()  # the last forward without a backward awaits one until then
    events = list(prov.events)
    stock = _model()
    _same(ours, _train(stock, _between(stock)))
    assert len(events) == STEPS * M and {(e.tokens, e.seq_len) for e in events} == {(BATCH * SEQ, SEQ)}  # the dropped ones are gone
    assert all(e.live_after_backward == 0 for e in events) and any(e.plan for e in events)


def test_a_step_that_raises_leaves_nothing_behind():
    model = _model()
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": _capacity(model)}, "strategies": EXACT, "pipeline": {"micro_batches": M}})
    ids = _batches()[0][0]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(ValueError, match="batch_size"):
        model(input_ids=ids, labels=ids[:, :5])  # labels of the wrong length: HF's loss raises inside the forward
    assert prov.running_kind is None and top_hooks() == (same, same) and not prov.runtime._forwarding  # no saved-tensor hooks
    loss = model(input_ids=ids, labels=ids).loss  # raises after its forward: its backward never comes
    del loss
    model(input_ids=ids, labels=ids).loss.backward()
    assert [e.micro_batch for e in prov.events] == [0, 0]  # each a new optimizer step's first
    assert not prov.awaits_backward() and prov.ledger.live_device_bytes == 0
    prov.remove()


def test_the_figures_count_the_micro_batches_since_the_last_call_an_abandoned_one_aside():
    model = _model()
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": _capacity(model)}, "strategies": EXACT, "pipeline": {"micro_batches": M}})
    ids = _batches()[0][0]
    model(input_ids=ids, labels=ids).loss.backward()
    loss = model(input_ids=ids, labels=ids).loss  # its forward ends; its backward never comes
    assert prov.figures()["bagualu/micro_batches"] == 2  # reported while it awaited its backward
    del loss
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()  # the first abandons the one that never went backward
    assert prov.figures()["bagualu/micro_batches"] == 3 and prov.figures()["bagualu/micro_batches"] == 0
    prov.remove()


def test_a_peft_model_forward_counts_once():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": "1GiB"}, "pipeline": {"micro_batches": 2}})
    for ids in _batches()[0][:2]:
        model(input_ids=ids, labels=ids).loss.backward()
    assert [e.micro_batch for e in prov.events] == [0, 1] and not prov.awaits_backward()
    prov.remove()


def test_a_larger_micro_batch_than_any_before_is_checked_against_the_capacity():
    model = _model()
    prov = bgl.apply(model, {"hardware": {"capacity_bytes": _capacity(model, share=0.05)}, "strategies": EXACT})
    small = _batches()[0][0][:, :4]
    model(input_ids=small, labels=small).loss.backward()
    m0 = prov.stage.min_budget
    big = torch.randint(0, 128, (8, 256))
    refused = r"micro-batch 0 of 2048 tokens \(8 x 256\) cannot fit: pipeline rank 0 of 1: capacity \d+ bytes cannot hold"
    with pytest.raises(ValueError, match=refused):
        model(input_ids=big, labels=big)
    assert prov.running_kind is None and prov.stage.min_budget == m0  # still planned for what fits
    model(input_ids=small, labels=small).loss.backward()
    prov.remove()


def test_a_plain_accelerate_loop():
    from accelerate import Accelerator

    from bagualu_plugin.integrations.accelerate import apply

    def run(plugin: bool):
        model = _model()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=M)
        prov = apply(model, {"hardware": {"capacity_bytes": _capacity(model)}, "strategies": EXACT}, accelerator) if plugin else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = []
        for step in _batches():
            for ids in step:
                with accelerator.accumulate(model):
                    loss = model(input_ids=ids, labels=ids).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.detach())
        if prov:
            prov.remove()
        return (losses, [p.detach().clone() for p in model.parameters()]), prov

    ours, prov = run(True)
    _same(ours, run(False)[0])
    assert [e.micro_batch for e in prov.events] == list(range(M)) * STEPS  # the accelerator's accumulation steps
    assert any(e.plan for e in prov.events) and prov.peak_device_bytes <= prov.stage.capacity


def test_autocast_entered_inside_the_models_forward_is_planned_for_from_the_next_micro_batch():
    """accelerate's prepare wraps the forward in autocast (mixed_precision bf16), out of sight of
    the model's pre-hooks: the decoder's hook sees it before anything is saved, the micro-batch
    is measured as one that runs under it (its FP32 router's BF16 copies), and every later one is
    planned so; a forward that no longer runs under it is corrected the same way. A loop's own
    autocast around the model is seen at once; under the Trainer the callback says so from the
    first micro-batch (its accelerator's mixed precision: tests/test_exactness_sweep.py)."""
    model = tiny_model("deepseek_v3", dtype=torch.bfloat16)
    unplanned = model_cost(model, kind=ForwardKind(autocast="bf16")).activation_bytes(BATCH * SEQ, seq_len=SEQ)
    recipe = {"hardware": {"capacity_bytes": 10 * unplanned}, "budget": {"non_activation_bytes": 0}, "telemetry": {"enabled": False}}
    ids = _batches()[0][0]
    wrapped = model.forward
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(wrapped)
    prov = bgl.apply(model, recipe)
    begun = []
    begin = prov.begin_forward
    prov.begin_forward = lambda *a, **k: begun.append(a[1].kind.autocast) or begin(*a, **k)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
    model.forward = wrapped
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()  # no autocast: a plain BF16 forward again
    events = list(prov.events)
    prov.remove()
    assert begun == [None, "bf16", "bf16", "bf16", "bf16"]  # what each was planned as
    assert [e.kind["autocast"] for e in events] == ["bf16"] * 4 + [None]  # what each ran as, measured so
    assert not any(e.misses for e in events)
