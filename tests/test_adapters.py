"""Adapters: layers and ops of every family, op tracking, the gate hook, the "bagualu" experts
implementation (bitwise equal to transformers' grouped_mm), emulated expert parallelism and the
deterministic routing skew. All on tiny random models of the six families, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import plan_step
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, LlamaConfig
from transformers.integrations.finegrained_fp8 import FP8Experts, Fp8Quantize, replace_with_fp8_linear
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from bagualu_plugin.adapters import (
    FAMILIES,
    IMPLEMENTATION,
    TINY_CONFIGS,
    Adapter,
    OpTracker,
    UnsupportedModelError,
    is_inside_backward,
    list_ops,
    local_expert_range,
    save_tiny,
    tiny_model,
)
from bagualu_plugin.adapters.costs import model_dims
from bagualu_plugin.adapters.experts import require_plain_weights
from bagualu_plugin.adapters.gate import GateMonitor, RoutingSkew, tokens_per_expert
from bagualu_plugin.costmodel import CostModel, ForwardKind

FAMS = sorted(FAMILIES)
DENSE_FIRST = {"glm4_moe", "deepseek_v3", "qwen2_moe", "qwen3_moe"}  # tiny configs: layer 0 is dense
WITH_SHARED = {"glm4_moe", "deepseek_v3", "qwen2_moe"}
E, K = 8, 2  # experts and top-k of every tiny config
EXPERT_OPS = ["expert_fc1", "expert_act", "expert_fc2"]


def batch(seed: int = 1, tokens: int = 24, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 128, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def model_of(family: str, impl: str = "grouped_mm", dtype=torch.float32, **overrides):
    model = tiny_model(family, dtype=dtype, **overrides)
    model.set_experts_implementation(impl)
    return model


def step(model, ids: torch.Tensor):
    """Loss and every parameter gradient of one forward/backward."""
    return plan_step(model, ids, labels=ids, grads="all", named=True)[:2]


def assert_bitwise(reference, other):
    loss0, grads0 = reference
    loss1, grads1 = other
    assert torch.equal(loss0, loss1), (loss0.item(), loss1.item())
    assert grads0.keys() == grads1.keys()
    unequal = [n for n in grads0 if not (grads0[n] is None and grads1[n] is None or torch.equal(grads0[n], grads1[n]))]
    assert not unequal, f"{len(unequal)} gradients differ, e.g. {unequal[:3]}"


def moe_layers(model) -> list:
    return [layer for layer in Adapter(model).layers if layer.moe]


class RouterCapture:
    """Our own forward hook on every router: what it really returned (registered last, or first
    with prepend=True to see the routing before other hooks rewrite it)."""

    def __init__(self, model, prepend: bool = False):
        self.index: dict[int, list[torch.Tensor]] = {}
        self.inside_backward = 0
        self.handles = [
            layer.router.register_forward_hook(self._hook(layer.index), prepend=prepend) for layer in moe_layers(model)
        ]

    def _hook(self, index):
        def hook(module, args, output):
            if is_inside_backward():
                self.inside_backward += 1
            self.index.setdefault(index, []).append(output[2].clone())

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


class SavedBytes:
    """Bytes the autograd graph saves for each experts module, as a ledger would count them: our
    own saved_tensors_hooks around the whole forward, storages deduplicated by data_ptr,
    parameters excluded, and a storage charged to a layer's experts only if nothing outside them
    saves it too (inputs the experts share with the router are not theirs)."""

    def __init__(self, model):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._scope = None
        self._scopes: dict[int, set] = {}
        self._tensors: dict[int, torch.Tensor] = {}  # held: no address reuse while we count
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.handles = []
        for layer in moe_layers(model):
            self.handles.append(layer.experts.register_forward_pre_hook(self._enter(layer.index)))
            self.handles.append(layer.experts.register_forward_hook(self._exit))

    def _pack(self, tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self._params:
            self._tensors[ptr] = tensor
            self._scopes.setdefault(ptr, set()).add(self._scope)
        return tensor

    def _enter(self, index):
        def pre_hook(module, args):
            self._scope = index

        return pre_hook

    def _exit(self, module, args, output):
        self._scope = None

    @property
    def bytes(self) -> dict[int, int]:
        totals: dict[int, int] = {}
        for ptr, scopes in self._scopes.items():
            if len(scopes) == 1 and None not in scopes:
                (index,) = scopes
                totals[index] = totals.get(index, 0) + self._tensors[ptr].untyped_storage().nbytes()
        return totals

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        for handle in self.handles:
            handle.remove()


# --- Adapter / list_ops ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMS)
def test_layers_and_ops(family):
    model = tiny_model(family)
    adapter = Adapter(model)
    moe = [layer.moe for layer in adapter.layers]
    assert moe == ([False] + [True] * (len(moe) - 1) if family in DENSE_FIRST else [True] * len(moe))
    for layer in adapter.layers:
        mlp = layer.module.mlp
        if layer.moe:
            assert layer.router is getattr(mlp, FAMILIES[family].router) and layer.experts is mlp.experts
            assert layer.experts.num_experts == E
    assert adapter.num_experts == E and adapter.top_k == K

    ops = list_ops(model)
    assert ops == adapter.ops()
    assert ops[0].layer == -1 and ops[0].name == "embed"
    assert [op.name for op in ops[-3:]] == ["final_norm", "lm_head", "loss"]
    attn = ["attn_norm", "attn_qkv", "attn_core", "attn_out", "mlp_norm"]
    for layer in adapter.layers:
        names = [op.name for op in ops if op.layer == layer.index]
        if not layer.moe:
            assert names == attn + ["dense_mlp"]
        else:
            assert names == attn + ["router"] + EXPERT_OPS + (["shared_expert"] if family in WITH_SHARED else [])


@pytest.mark.parametrize("family", FAMS)
def test_traits_match_the_hf_modules(family):
    """The traits the cost model reads, checked against the modules transformers builds."""
    traits = FAMILIES[family]
    layer = moe_layers(tiny_model(family))[0]
    mlp, attn = layer.module.mlp, layer.module.self_attn
    assert all(hasattr(mlp, name) for name in traits.shared)
    assert hasattr(mlp, "shared_expert_gate") == traits.shared_expert_gated
    assert hasattr(attn, "sinks") == traits.attention_sinks
    assert hasattr(attn, "kv_b_proj") == traits.mla
    assert hasattr(layer.experts, "down_proj_bias") == traits.expert_bias


def test_every_family_has_a_tiny_model():
    assert set(TINY_CONFIGS) == set(FAMILIES)


def test_unsupported_model_names_model_type_and_supported():
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError) as info:
        list_ops(model)
    message = str(info.value)
    assert "'llama'" in message
    assert all(family in message for family in FAMS)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_block_without_router_names_it(family):
    model = tiny_model(family)
    layer = moe_layers(model)[0]
    name = FAMILIES[family].router
    delattr(layer.module.mlp, name)
    with pytest.raises(UnsupportedModelError, match=f"layer {layer.index}.*'{name}'"):
        Adapter(model)


def test_wrappers_are_unwrapped():
    model = tiny_model("mixtral")

    class PeftModelForCausalLM(nn.Module):  # the shape of a PEFT wrapper
        def __init__(self, base):
            super().__init__()
            self.base_model = base

        def get_base_model(self):
            return self.base_model

    expected = list_ops(model)
    for wrapped in (PeftModelForCausalLM(model), torch.compile(model), torch.compile(PeftModelForCausalLM(model))):
        assert Adapter(wrapped).model is model
        assert list_ops(wrapped) == expected


# --- OpTracker ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMS)
def test_tracker_sees_expert_ops_in_order(family):
    sequences = {}
    for impl in ("grouped_mm", IMPLEMENTATION):
        model = model_of(family, impl)
        tracker = OpTracker(Adapter(model)).install()
        seen = []
        tracker.listeners.append(seen.append)
        model(input_ids=batch())
        tracker.remove()
        sequences[impl] = seen

    seen = sequences[IMPLEMENTATION]
    assert seen[0].name == "embed" and [op.name for op in seen[-3:]] == ["final_norm", "lm_head", "loss"]
    for layer in moe_layers(model):
        names = [op.name for op in seen if op.layer == layer.index]
        start = names.index("router")
        assert names[start : start + 4] == ["router"] + EXPERT_OPS
    # transformers' grouped_mm is one opaque op: only its fc1 scope (the module pre-hook) shows.
    default_names = {op.name for op in sequences["grouped_mm"]}
    assert "expert_fc1" in default_names and not {"expert_act", "expert_fc2"} & default_names


# --- gate hook ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMS)
def test_gate_counts_match_router_output(family):
    model = model_of(family, IMPLEMENTATION)
    calls = []
    ran = set()
    for layer in moe_layers(model):
        layer.experts.register_forward_pre_hook(lambda m, a, i=layer.index: ran.add(i))
    monitor = GateMonitor(model, on_gate=lambda i, c, s: calls.append((i, i in ran))).install()
    capture = RouterCapture(model)
    model(input_ids=batch())
    assert calls == [(layer.index, False) for layer in moe_layers(model)]  # at gate time: experts not run yet
    pairs = monitor.local_pairs()
    for layer in moe_layers(model):
        (index,) = capture.index[layer.index]
        assert torch.equal(monitor.counts(layer.index), torch.bincount(index.flatten(), minlength=E))
        assert pairs[layer.index] == index.numel()  # one process hosts every expert
    assert sum(monitor.counts(moe_layers(model)[0].index)).item() == batch().numel() * K
    monitor.reset()
    assert monitor.local_pairs() == {}
    with pytest.raises(KeyError, match="no routing recorded"):
        monitor.counts(moe_layers(model)[0].index)
    monitor.remove()
    model(input_ids=batch())
    assert monitor.local_pairs() == {} and len(calls) == len(moe_layers(model))


def test_gate_ignores_sentinel_indices():
    model = tiny_model("qwen3_moe")
    layer = moe_layers(model)[0]
    sentinel = torch.tensor([[0, E], [E + 3, 2], [2, 3], [E, E]])

    def to_sentinels(module, args, output):
        return output[0], output[1], sentinel

    layer.router.register_forward_hook(to_sentinels)
    monitor = GateMonitor(model).install()
    layer.router(torch.randn(4, 64))
    assert monitor.counts(layer.index).tolist() == [1, 0, 2, 1, 0, 0, 0, 0]
    assert monitor.local_pairs() == {layer.index: 4}
    assert tokens_per_expert(torch.tensor([-1, 0, 7, 8]), E).tolist() == [1, 0, 0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_gate_does_not_decide_again_in_backward_recompute(family):
    model = model_of(family, IMPLEMENTATION)
    model.gradient_checkpointing_enable()  # the name every 5.x release has
    calls = []
    monitor = GateMonitor(model, on_gate=lambda i, c, s: calls.append(i)).install()
    capture = RouterCapture(model)
    loss = model(input_ids=batch(), labels=batch()).loss
    layers = [layer.index for layer in moe_layers(model)]
    assert calls == layers
    recorded = {i: monitor.counts(i) for i in layers}
    loss.backward()
    assert capture.inside_backward == len(layers)  # the routers really ran again, inside backward
    assert calls == layers
    assert all(monitor.counts(i) is recorded[i] for i in layers)


def test_gate_monitor_validates():
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="on_gate"):
        GateMonitor(model, on_gate=3)


# --- bagualu experts == grouped_mm --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bagualu_equals_default_bitwise(family, dtype):
    ids = batch()
    reference = step(model_of(family, "grouped_mm", dtype), ids)
    model = model_of(family, IMPLEMENTATION, dtype)
    assert model.config._experts_implementation == IMPLEMENTATION
    assert_bitwise(reference, step(model, ids))


def test_bagualu_via_from_pretrained(tmp_path):
    save_tiny("glm4_moe", tmp_path)
    ids = batch()
    default = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).train()
    model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="bagualu", local_files_only=True)
    model.train()
    assert model.config._experts_implementation == "bagualu"
    used = []
    for layer in moe_layers(model):
        layer.experts.expert_op_runner = lambda unit, op, *args, **kw: used.append(unit) or op(*args, **kw)
    assert_bitwise(step(default, ids), step(model, ids))
    assert used == [tuple(EXPERT_OPS), *((name,) for name in EXPERT_OPS)] * len(moe_layers(model))


def test_op_runner_wraps_each_op_with_checkpoint():
    """The seam a runtime uses: each op alone under a checkpoint still gives equal results."""
    ids = batch()
    reference = step(model_of("gpt_oss", "grouped_mm"), ids)
    model = model_of("gpt_oss", IMPLEMENTATION)

    def recompute(unit, op, *args, **kwargs):
        if len(unit) > 1:  # the routed experts as a whole: run as they are
            return op(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(op, *args, use_reentrant=False, **kwargs)

    with SavedBytes(model) as kept:
        step(model, ids)
    for layer in moe_layers(model):
        layer.experts.expert_op_runner = recompute
    with SavedBytes(model) as recomputed:
        assert_bitwise(reference, step(model, ids))
    # Only the op boundaries (fc1's and act's outputs) stay: fewer bytes than without recompute.
    assert recomputed.bytes.keys() == kept.bytes.keys()
    assert all(0 < recomputed.bytes[i] < kept.bytes[i] for i in kept.bytes)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_routing_skew_moves_no_memory_in_one_process(family):
    """Every expert is local without expert parallelism: a skew changes which experts get the
    pairs, not how many pairs (or bytes) the experts keep."""
    model = model_of(family, IMPLEMENTATION)
    ids = batch(tokens=32)
    saved = []
    for fraction in (0.0, 1.0):
        with RoutingSkew(model, fraction, 4, 1), SavedBytes(model) as kept:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        saved.append(kept.bytes)
    assert saved[0] == saved[1]


# --- quantized checkpoints -----------------------------------------------------------------------

REFUSAL = r"quant_method='fp8'.*FineGrainedFP8Config\(dequantize=True\)"


def fp8_checkpoint(directory: Path) -> Path:
    """A tiny DeepSeek-V3 checkpoint as DeepSeek ships its own: every projection in FP8 with its
    blockwise weight_scale_inv, quantized by transformers' Fp8Quantize (16x16 blocks: tiny dims)."""
    config = FineGrainedFP8Config(weight_block_size=(16, 16))
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    weights = load_file(save_tiny("deepseek_v3", directory) / "model.safetensors")
    quantized = {}
    for key, value in weights.items():
        quantized.update(quantize.convert({key: value}) if key.endswith("_proj.weight") else {key: value})
    save_file(quantized, directory / "model.safetensors", metadata={"format": "pt"})
    fields = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**fields, "quantization_config": config.to_dict()}))
    return directory


def test_experts_loaded_in_fp8_refuse_bagualu_with_the_way_to_load_them():
    """On a GPU transformers loads an FP8 checkpoint's experts as its FP8Experts, which dispatch
    through its FP8 experts interface: "bagualu" there is the refusal, not a KeyError at the first
    forward. Built by transformers' own swap, as from_pretrained does (FP8 itself needs a GPU); the
    other layers stay plain so that the model runs on CPU up to the experts."""
    model = model_of("deepseek_v3", IMPLEMENTATION)
    plain = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    config = FineGrainedFP8Config(weight_block_size=(16, 16))
    replace_with_fp8_linear(model, modules_to_not_convert=plain, quantization_config=config, pre_quantized=True)
    assert all(isinstance(layer.experts, FP8Experts) for layer in moe_layers(model))
    ids = batch()
    with pytest.raises(ValueError, match=REFUSAL):
        model(input_ids=ids, labels=ids)


@pytest.mark.parametrize(
    "dequantize",
    [True, pytest.param(False, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU loads it in FP8: refused"))],
    ids=["dequantize", "cpu-default"],
)
def test_an_fp8_checkpoint_loaded_dequantized_runs_bagualu(tmp_path, dequantize):
    """The way the refusal names: FineGrainedFP8Config(dequantize=True) gives plain weights, on which
    "bagualu" equals grouped_mm bitwise, as does a CPU's own fallback without it."""
    path = fp8_checkpoint(tmp_path)
    quantization = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if dequantize else {}

    def load(impl):
        return AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl, local_files_only=True, **quantization).train()

    model = load(IMPLEMENTATION)
    weight, original = moe_layers(model)[0].experts.gate_up_proj, moe_layers(tiny_model("deepseek_v3"))[0].experts.gate_up_proj
    assert not torch.equal(weight, original) and (weight - original).abs().max() < 0.1 * original.abs().max()  # FP8, dequantized
    require_plain_weights(model.config)
    ids = batch()
    assert_bitwise(step(load("grouped_mm"), ids), step(model, ids))


# --- RoutingSkew -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMS)
def test_routing_skew_moves_selected_pairs_local(family):
    model = model_of(family, IMPLEMENTATION)
    ep_size, ep_rank, fraction = 4, 1, 0.4
    monitor = GateMonitor(model).install()  # before the skew, yet sees its routing
    after = RouterCapture(model)
    skew = RoutingSkew(model, fraction, ep_size, ep_rank).install()
    before = RouterCapture(model, prepend=True)  # runs ahead of the skew: the router's own routing
    ids = batch()
    for _ in range(2):
        model(input_ids=ids)
    local = local_expert_range(E, ep_size, ep_rank)
    for layer in moe_layers(model):
        old, new = before.index[layer.index][0], after.index[layer.index][0]
        assert torch.equal(new, after.index[layer.index][1])  # deterministic across forwards
        is_local = lambda x: (x >= local.start) & (x < local.stop)  # noqa: E731
        mask = skew.mask(*old.shape, layer.index)
        moved = mask & ~is_local(old)
        assert abs(int(mask.sum()) - fraction * old.numel()) <= 2
        assert torch.equal(new[~moved], old[~moved]) and bool(is_local(new[moved]).all())
        on_rank = int(monitor.counts(layer.index)[local.start : local.stop].sum())
        assert on_rank == int(is_local(old).sum()) + int(moved.sum())
        assert int(moved.sum()) > 0
        assert bool((new[:, 0] != new[:, 1]).all())  # 2 local experts for top-2: no duplicates


def test_routing_skew_survives_recompute():
    """No RNG: the routing a checkpoint recomputes is the routing of the forward."""
    ids = batch()
    results = []
    for checkpointing in (False, True):
        model = model_of("glm4_moe", IMPLEMENTATION)
        if checkpointing:
            model.gradient_checkpointing_enable()  # the name every 5.x release has
        skew = RoutingSkew(model, 0.5, 4, 2).install()
        results.append(step(model, ids))
        skew.remove()
    assert_bitwise(*results)


def test_routing_skew_fraction_and_arguments():
    model = tiny_model("mixtral")
    for fraction in (0.0, 0.1, 0.5, 0.9, 1.0):
        skew = RoutingSkew(model, fraction, 2, 0)
        for tokens in (7, 64, 333):
            for layer in (0, 1):
                count = int(skew.mask(tokens, K, layer).sum())
                assert abs(count - fraction * tokens * K) <= 2, (fraction, tokens, count)
    assert not torch.equal(RoutingSkew(model, 0.5, 2, 0).mask(64, K, 0), RoutingSkew(model, 0.5, 2, 0).mask(64, K, 1))
    for bad in (-0.1, 1.5, "0.5", True, float("nan")):
        with pytest.raises(ValueError, match="fraction"):
            RoutingSkew(model, bad, 2, 0)
    with pytest.raises(ValueError, match="ep_size"):
        RoutingSkew(model, 0.5, 3, 0)
    with pytest.raises(ValueError, match="ep_rank"):
        RoutingSkew(model, 0.5, 2, 2)
    with pytest.raises(ValueError, match="not MoE layers"):
        RoutingSkew(model, 0.5, 2, 0, layers=[5])
    dense_first = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"\[0\].*MoE layers: \[1, 2\]"):
        RoutingSkew(dense_first, 0.5, 2, 0, layers=[0])
    with pytest.raises(ValueError, match="layers"):
        RoutingSkew(dense_first, 0.5, 2, 0, layers=1)
    skew = RoutingSkew(dense_first, 1.0, 2, 0, layers=[2])
    assert [layer.index for layer in skew.layers] == [2]


@pytest.mark.parametrize("ep_size, top_k", [(4, 4), (4, 3), (2, 4), (8, 4)])
def test_routing_skew_rewrite_keeps_each_token_on_distinct_experts(ep_size, top_k):
    """16 experts: while the rank hosts at least k of them, no token lists one expert twice, and
    every selected remote pair lands on a local expert."""
    model = tiny_model("mixtral", num_local_experts=16, num_experts_per_tok=top_k)
    skew = RoutingSkew(model, 0.7, ep_size, 1)
    generator = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(16, generator=generator)[:top_k] for _ in range(300)])
    for layer in (0, 1):
        new = skew.rewrite(index, layer)
        local = skew.local[layer]
        moved = skew.mask(300, top_k, layer) & ((index < local.start) | (index >= local.stop))
        assert torch.equal(new[~moved], index[~moved])
        assert bool(((new[moved] >= local.start) & (new[moved] < local.stop)).all())
        distinct = torch.sort(new, dim=1).values.diff(dim=1).ne(0).all(dim=1)
        assert bool(distinct.all()) == (len(local) >= top_k)


def test_a_provisioners_gate_takes_the_local_pairs_without_counting_them():
    """`per_expert=False` (the Provisioner's monitor): in one process every expert is local, so the
    pairs are the router's top-k slots, read without a kernel or a host synchronisation."""
    model = model_of("qwen3_moe", IMPLEMENTATION)
    calls = []
    monitor = GateMonitor(model, on_gate=lambda i, c, s: calls.append((c, s)), per_expert=False).install()
    model(input_ids=batch())
    assert calls == [(None, batch().numel() * K)] * len(moe_layers(model))
    assert monitor.local_pairs() == {layer.index: batch().numel() * K for layer in moe_layers(model)}
    with pytest.raises(KeyError, match="no per-expert counts"):
        monitor.counts(moe_layers(model)[0].index)
    monitor.remove()


@pytest.mark.parametrize(("family", "extra"), [("glm4_moe", 2), ("deepseek_v3", 2), ("qwen3_moe", 0), ("mixtral", 0)])
def test_cuda_autocast_keeps_a_renormalising_sigmoid_routers_sum_in_fp32(family, extra):
    """CUDA's autocast runs `sum` in FP32 on a half-precision tensor, the CPU's does not: where a
    router renormalises BF16 sigmoid scores (GLM-4, DeepSeek-V3) the sum it keeps is FP32 on CUDA,
    2 more bytes per token and MoE layer; a softmax router's scores are FP32 already. (Every other
    op these families run on half-precision tensors has the same autocast policy on both: checked
    against the dispatcher's Autocast kernels.)"""
    dims = model_dims(tiny_model(family))
    priced = {
        device: CostModel.from_config(dims.model_copy(update={"autocast": "bf16", "device": device})).activation_bytes(64, seq_len=32)
        for device in ("cpu", "cuda")
    }
    moe = dims.num_layers - dims.first_k_dense
    assert priced["cuda"] - priced["cpu"] == extra * 64 * moe


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_router_weight_stored_in_the_model_dtype_is_read_off_the_model_and_priced(autocast):
    """transformers before 5.2x keep GLM-4-MoE's router weight in the model's dtype (5.2x: FP32);
    the router still hands its linear an FP32 copy, which it keeps (under autocast, the cast of that
    copy). Here as on 5.17: the weight cast to BF16 in place of the FP32 one."""
    from bagualu_plugin.adapters.costs import model_cost

    model = tiny_model("glm4_moe", dtype=torch.bfloat16)
    for layer in Adapter(model).layers:
        if layer.moe:
            layer.router.weight = nn.Parameter(layer.router.weight.detach().to(torch.bfloat16))
    assert model_dims(model).router_dtype == "bf16"
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    saved = plan_step(model, ids, {}, autocast=autocast)[2]
    cm = model_cost(model, kind=ForwardKind(autocast=None if autocast is None else "bf16"))
    assert saved == cm.activation_bytes(32, seq_len=16)


def test_transformers_expert_parallelism_is_read_where_the_release_marks_no_experts():
    """5.2x mark the experts they shard (`_is_expert_parallel`); older 5.x releases do not, and
    read the model's `distributed_config` instead."""
    from transformers.distributed import DistributedConfig

    from bagualu_plugin.adapters.experts import sharded

    experts = next(layer.experts for layer in Adapter(tiny_model("qwen3_moe")).layers if layer.moe)
    assert not sharded(experts)
    if hasattr(experts, "_is_expert_parallel"):
        del experts._is_expert_parallel  # as before 5.2x
    assert not sharded(experts)
    experts.config.distributed_config = DistributedConfig()
    experts.config.distributed_config.enable_expert_parallel = True  # the field 5.17's expert parallelism sets
    assert sharded(experts)
