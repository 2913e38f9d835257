"""Per micro-batch, `PlanRuntime.forward` redoes nothing that did not change: the op-scope and plan
hooks are installed once (`install` .. `remove`) and do nothing outside a training forward, and
the Ledger walks the model only when a parameter or buffer was registered, replaced or moved."""

import pytest
import torch
from torch import nn

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.costmodel import OpId
from bagualu_plugin.costmodel.plan import Plan
from bagualu_plugin.runtime.ledger import Ledger, _storage
from bagualu_plugin.runtime.plan_runtime import PlanRuntime, apply_plan
from bagualu_plugin.runtime.regions import same, top_hooks

g = torch.Generator().manual_seed(0)
BATCHES = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(3)]


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _runtime(model, plan=()) -> PlanRuntime:
    runtime = PlanRuntime(model).install()
    runtime.set_plan(Plan(dict(plan)))
    return runtime


def _micro_batch(runtime: PlanRuntime, mb: int, ids: torch.Tensor, backward: bool = True):
    """The bytes micro-batch `mb` keeps, after its backward; else also its loss (its graph)."""
    runtime.micro_batches.running = mb
    with runtime.forward():
        loss = runtime.adapter.model(input_ids=ids, labels=ids).loss
    kept = runtime.ledger.by_micro_batch().get(mb, 0)
    if backward:
        loss.backward()
        return kept
    return kept, loss


def _walks(monkeypatch) -> list:
    walks = []
    refresh = Ledger.refresh
    monkeypatch.setattr(Ledger, "refresh", lambda self: walks.append(self) or refresh(self))
    return walks


def test_hooks_are_installed_once_and_removed_with_the_runtime():
    model = tiny_model("glm4_moe")
    bare = _hooks(model)
    runtime = _runtime(model, {OpId(1, "attn_core"): "recompute", OpId(1, "expert_fc1"): "offload"})
    installed = _hooks(model)
    assert installed > bare
    inside = []
    for mb, ids in enumerate(BATCHES):
        runtime.micro_batches.running = mb
        with runtime.forward():
            inside.append(_hooks(model))
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert inside == [installed] * len(BATCHES) and _hooks(model) == installed
    runtime.remove()
    assert _hooks(model) == bare and not hasattr(runtime.adapter.layers[1].experts, "_bagualu_scope")


def test_the_hooks_do_nothing_outside_a_training_forward():
    """Evaluation, a no_grad forward, `generate` and a training-mode forward outside the block: no
    op scope, no saved-tensor hooks, nothing recorded or remembered; inside it they all run."""
    model = tiny_model("glm4_moe")
    runtime = _runtime(model, {OpId(1, "expert_fc1"): "offload"})
    entered, calls = [], []
    runtime.tracker.listeners.append(entered.append)
    hooks = runtime.hooks
    for name in ("layer_inputs", "new_forward", "pack"):
        method = getattr(hooks, name)
        setattr(hooks, name, lambda *a, _m=method, _n=name, **kw: calls.append(_n) or _m(*a, **kw))
    ids = BATCHES[0]
    try:
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)
        model.train()
        with torch.no_grad():
            model(input_ids=ids)
        model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
        out = model(input_ids=ids, labels=ids).loss  # a training forward nobody planned
        assert (entered, calls, runtime.tracker.current, runtime.ledger.records()) == ([], [], None, [])
        assert top_hooks() == (same, same) and not hooks._forms and not any(runtime.micro_batches)
        out.backward()
        kept = _micro_batch(runtime, 0, ids)
        assert kept > 0 and OpId(1, "expert_fc1") in entered and {"layer_inputs", "new_forward", "pack"} <= set(calls)
        assert runtime.tracker.current is None  # the block ends with no op scope
    finally:
        runtime.remove()


def test_a_replay_after_the_block_runs_no_op_scope_and_keeps_gradients_bitwise():
    """A recompute region replaying in backward after the block replays its forward's decisions:
    the op scopes stay off there (as when the hooks were removed at the block's end), and inside
    the block (a fused executor running another micro-batch's backward) they run."""
    plan = {OpId(1, "attn_core"): "recompute", OpId(1, "shared_expert"): "recompute", OpId(2, "expert_act"): "recompute"}
    model = tiny_model("glm4_moe", num_hidden_layers=3)
    ids = BATCHES[0]
    model(input_ids=ids, labels=ids).loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    for inside in (False, True):
        model.zero_grad(set_to_none=True)
        runtime = _runtime(model, plan)
        entered = []
        try:
            with runtime.forward():
                loss = model(input_ids=ids, labels=ids).loss
                runtime.tracker.listeners.append(entered.append)
                if inside:
                    loss.backward()
            if not inside:
                loss.backward()
        finally:
            runtime.remove()
        assert bool(entered) == inside
        assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference))


def test_no_walk_on_a_micro_batch_where_nothing_changed(monkeypatch):
    model = tiny_model("glm4_moe")
    runtime = _runtime(model, {OpId(1, "expert_fc2"): "offload"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    walks = _walks(monkeypatch)
    try:
        for mb, ids in enumerate(BATCHES):
            _micro_batch(runtime, mb, ids)
            optimizer.step()  # in place: the storages stay
            optimizer.zero_grad()
        with runtime.ledger.track():
            pass
        assert walks == []
        model.model.norm.register_buffer("gain", torch.ones(model.config.hidden_size))
        _micro_batch(runtime, 0, BATCHES[0])
        _micro_batch(runtime, 1, BATCHES[1])
        assert walks == [runtime.ledger]  # once, at the first forward after the change
    finally:
        runtime.remove()


def _replace_a_weight(model):
    proj = model.model.layers[1].self_attn.q_proj
    proj.weight = nn.Parameter(proj.weight.detach().clone())
    return [proj.weight]


def _to_bfloat16(model):
    model.to(torch.bfloat16)  # grouped_mm has no float64 kernel; any new dtype is new storages
    return [*model.parameters(), *model.buffers()]


def _to_bfloat16_overwriting(model):
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # new Parameter objects, no registration
    try:
        return _to_bfloat16(model)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)


def _to_bfloat16_swapping(model):
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # the same objects, their contents swapped
    try:
        return _to_bfloat16(model)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _swap_data(model):
    proj = model.model.layers[0].self_attn.o_proj
    proj.weight.data = proj.weight.detach().clone()  # what `.to()` does by default, on one parameter
    return [proj.weight]


def _written_directly(model):
    proj = model.model.layers[1].self_attn.o_proj  # as FSDP2 and accelerate write `_parameters`
    proj._parameters["weight"] = nn.Parameter(proj.weight.detach().clone())
    return [proj.weight]


def _new_buffer(model):
    norm = model.model.norm
    norm.register_buffer("gain", torch.full((model.config.hidden_size,), 1.5))
    norm.register_forward_hook(lambda m, args, out: out * m.gain)  # saves only the buffer, for out's gradient
    return [norm.gain]


def _new_module(model):
    """PEFT-like: a wrapper with its own parameters put in place of a projection (registered
    elsewhere, then attached: only the attachment is a registration on the model)."""

    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.scale = inner, nn.Parameter(torch.full((inner.out_features,), 0.5))

        def forward(self, x):
            return self.inner(x) * self.scale

    attn = model.model.layers[1].self_attn
    attn.o_proj = Scaled(attn.o_proj)
    return [attn.o_proj.scale]


CHANGES = [_replace_a_weight, _to_bfloat16, _to_bfloat16_overwriting, _to_bfloat16_swapping, _swap_data, _written_directly,
           _new_buffer, _new_module]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_change_between_micro_batches_is_seen_and_never_counted(change, monkeypatch):
    """Between two micro-batches a parameter or buffer is replaced, moved or added: the next
    forward walks once, counts exactly what a fresh ledger of the changed model counts (the
    activations, never a parameter or buffer), and the one after walks no more."""
    model = tiny_model("glm4_moe")
    runtime = _runtime(model)
    walks = _walks(monkeypatch)
    try:
        _micro_batch(runtime, 0, BATCHES[0])
        assert walks == []
        changed = change(model)
        ids = BATCHES[1]
        kept, loss = _micro_batch(runtime, 1, ids, backward=False)
        assert walks == [runtime.ledger]
        static = {found[0] for t in (*model.parameters(), *model.buffers()) if (found := _storage(t)) is not None}
        assert all(runtime.ledger.excludes(t) for t in changed)
        assert runtime.ledger.records() and not static & {r.key for r in runtime.ledger.records()}
        loss.backward()
        _micro_batch(runtime, 2, ids)
        assert walks == [runtime.ledger]
    finally:
        runtime.remove()
    with apply_plan(model, {}) as fresh:  # a fresh runtime's ledger (the plugin's experts: what transformers runs may save more)
        loss = model(input_ids=ids, labels=ids).loss  # noqa: F841 - its graph keeps the saved tensors alive
        assert kept == fresh.live_device_bytes > 0


def test_a_forward_whose_plan_stores_nothing_only_counts_its_saves():
    """A plan that keeps and recomputes only: the Ledger's own hooks count the saves (the plan's
    per-save lookups skipped), the same bytes per op and gradients as under the plan's hooks, which
    a plan storing nothing in practice (offloads under `offload_min_bytes`) still goes through.
    A storing plan set while such a forward runs is refused by name: its saves would not be stored."""
    from bagualu_plugin.costmodel.mitigation import MitigationOptions

    model = tiny_model("qwen3_moe")
    recompute = {OpId(1, "attn_core"): "recompute"}
    bytes_by_op, grads = [], []
    for stores in (False, True):  # the stored plan's offload is kept: it is under offload_min_bytes
        runtime = PlanRuntime(model, options=MitigationOptions(offload_min_bytes=1 << 40)).install()
        runtime.set_plan(Plan({**recompute, OpId(1, "expert_fc1"): "offload"} if stores else recompute))
        runtime.micro_batches.running = 0
        with runtime.forward():
            assert top_hooks()[0] == (runtime.hooks.pack if stores else runtime.ledger.pack)
            loss = model(input_ids=BATCHES[0], labels=BATCHES[0]).loss
            if not stores:
                with pytest.raises(ValueError, match="offloads or stores in FP8 while a forward runs"):
                    runtime.set_plan(Plan({OpId(1, "expert_fc1"): "offload"}))
        bytes_by_op.append(runtime.ledger.by_op(micro_batch=0))
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        runtime.remove()
    assert bytes_by_op[0] == bytes_by_op[1] and sum(bytes_by_op[0].values()) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))
