"""`bgl.profile` on real (tiny) HF MoE models: exact memory for loads it never saw."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import bagualu_plugin as bgl
from bagualu_plugin.adapters import FAMILIES, Adapter, UnsupportedModelError, save_tiny, tiny_model
from bagualu_plugin.cli import main
from bagualu_plugin.costmodel import CostModel, Forward, LinearForm, Load, ModelDims, OpId
from bagualu_plugin.costmodel.fit import BlockSample, TensorSample, fit_block, fit_linear
from bagualu_plugin.runtime.plan_runtime import apply_plan
from bagualu_plugin.runtime.profiler import measure_micro_batch


def _ids(batch: int, seq_len: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def qwen3_profile(qwen3):
    return bgl.profile(qwen3, [32, 64, 128], repeats=1)


@pytest.mark.parametrize("shape", [(3, 40), (1, 96), (5, 20)])
def test_profile_predicts_unseen_shapes_exactly(qwen3, qwen3_profile, shape):
    batch, seq_len = shape
    saved, routed, _ = measure_micro_batch(qwen3, _ids(batch, seq_len), repeats=0)
    predicted = qwen3_profile.activation_bytes(batch * seq_len, routed=[routed[i] for i in qwen3_profile.moe_layers], seq_len=seq_len)
    assert predicted == saved


def test_profiled_graph_names_ops_and_tensors(qwen3_profile):
    block = qwen3_profile.blocks[1]
    assert block.kind == "moe"
    assert block.op_names == (
        "attn_norm", "attn_qkv", "attn_core", "attn_out", "mlp_norm", "router", "expert_fc1", "expert_act", "expert_fc2",
    )
    owners = {block.owner(t) for t in block.tensors}
    assert {"expert_fc1", "expert_act", "expert_fc2", "router", "attn_core"} <= owners
    # expert tensors grow with routed pairs only, the others with tokens
    for t in block.tensors:
        if block.owner(t) in ("expert_act",):
            assert t.elements.per_routed > 0 and t.elements.per_token == 0
    assert qwen3_profile.source == "profiled" and qwen3_profile.name == "qwen3_moe"
    dense, expert = qwen3_profile.parameter_counts()
    model_params = sum(p.numel() for p in tiny_model("qwen3_moe").parameters())
    assert dense + expert == model_params


def test_profile_agrees_with_the_analytic_model(qwen3, qwen3_profile):
    analytic = CostModel.from_config(ModelDims.from_hf_config(qwen3.config, dtype="fp32", attention="sdpa"), "cpu")
    for tokens, seq_len in ((300, 100), (64, 64)):
        assert analytic.activation_bytes(tokens, seq_len=seq_len) == pytest.approx(
            qwen3_profile.activation_bytes(tokens, seq_len=seq_len), rel=1e-4
        )


def test_profile_predicts_ops_recomputed_through_their_spans():
    """Attention's ops and Qwen2-MoE's gated shared expert recomputed alone (their spans replay the
    attention module or the MoE block), also beside other strategies: exact to the byte."""
    model = tiny_model("qwen2_moe", dtype=torch.bfloat16)
    cm = bgl.profile(model, [32, 64, 128], repeats=1)
    ids = _ids(2, 48)
    alone = [OpId(i, n) for i in (0, 1, 2) for n in ("attn_qkv", "attn_core", "attn_out", "shared_expert") if i or n != "shared_expert"]
    mixed = {OpId(1, "attn_qkv"): "offload", OpId(1, "attn_core"): "recompute", OpId(1, "router"): "fp8"}
    mixed |= {OpId(1, "shared_expert"): "recompute", OpId(2, "attn_qkv"): "recompute", OpId(2, "attn_out"): "recompute"}
    for plan in [{op: "recompute"} for op in alone] + [mixed]:
        with apply_plan(model, plan) as ledger:
            loss = model(input_ids=ids, labels=ids).loss
            saved = ledger.live_device_bytes
        loss.backward()
        assert saved == cm.activation_bytes(96, seq_len=48, plan=plan), plan


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_profile_predicts_every_op_recomputed_alone(family, dtype):
    """A region holds what its op receives, saved by another op or not (the input ids, a norm's
    input it casts before saving, the routing weights expert_fc2 gathers, the loss's labels):
    exact to the byte; also the LM head and loss recomputed together, and everything."""
    model = tiny_model(family, dtype=dtype)
    cm = bgl.profile(model, [32, 64, 128], repeats=1)
    ids = _ids(2, 48)
    head = Adapter(model).head_index
    plans = [{op: "recompute"} for op in bgl.list_ops(model)]
    plans += [{OpId(head, "lm_head"): "recompute", OpId(head, "loss"): "recompute"}, cm.full_recompute()]
    for plan in plans:
        with apply_plan(model, plan) as ledger:
            loss = model(input_ids=ids, labels=ids.clone()).loss
            saved = ledger.live_device_bytes
        loss.backward()
        assert saved == cm.activation_bytes(96, seq_len=48, plan=plan), plan


def test_profile_round_trips_through_json(qwen3_profile, tmp_path):
    qwen3_profile.save(tmp_path / "cost.json")
    back = CostModel.load(tmp_path / "cost.json")
    assert back.activation_bytes(200, seq_len=50) == qwen3_profile.activation_bytes(200, seq_len=50)
    assert back.micro_batch(Forward(200, 50)) == qwen3_profile.micro_batch(Forward(200, 50))
    assert back.blocks[1].spans == qwen3_profile.blocks[1].spans != ()


def test_profile_restores_the_model(qwen3):
    before = qwen3.config._experts_implementation
    bgl.profile(qwen3, [16, 32, 64], repeats=1)
    assert qwen3.config._experts_implementation == before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in qwen3.modules())
    assert all(p.grad is None for p in qwen3.parameters())


@pytest.mark.parametrize(
    "counts, message",
    [
        ([], "non-empty"),
        ([64, -1, 32], "positive"),
        ([64, 64, 32], "at least 3"),
        ([16, 32, 50], "multiple of 4"),
        ([True, 64, 32], "positive"),
        ([64, 32, 10**6], "max_position"),
    ],
)
def test_bad_token_counts(qwen3, counts, message):
    with pytest.raises(ValueError, match=message):
        bgl.profile(qwen3, counts)


def test_unsupported_model():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(UnsupportedModelError, match="'llama'.*supported: deepseek_v3, glm4_moe, gpt_oss"):
        bgl.profile(llama, [16, 32, 64])
    with pytest.raises(UnsupportedModelError, match="llama"):
        bgl.list_ops(llama)


def test_list_ops(qwen3):
    ops = bgl.list_ops(qwen3)
    assert ops[0] == bgl.OpId(-1, "embed") and ops[-1] == bgl.OpId(3, "loss")
    assert bgl.OpId(0, "dense_mlp") in ops and bgl.OpId(1, "expert_fc1") in ops and bgl.OpId(1, "dense_mlp") not in ops


def test_fit_linear_is_exact_and_rejects_underdetermined_loads():
    loads = [Load(t, 2 * t, t * t, t) for t in (10, 20, 40)]
    form = fit_linear(loads, [3 + 5 * t for t in (10, 20, 40)], ["const", "per_token"])
    assert form == LinearForm(const=pytest.approx(3), per_token=pytest.approx(5))
    with pytest.raises(ValueError, match="do not determine"):
        fit_linear(loads, [1, 2, 3], ["per_token", "per_routed"])  # routed = 2 * tokens: collinear
    with pytest.raises(ValueError, match="unknown coefficients"):
        fit_linear(loads, [1, 2, 3], ["per_bogus"])


def test_fit_block_rejects_graphs_that_depend_on_the_input():
    loads = [Load.of(t, 0, t // b, top_k=2) for t in (16, 32, 64) for b in (1, 2, 4)]

    def sample(load, tensors):
        return BlockSample("moe", load, ("a", "b"), tuple(tensors), {"a": 1e-3}, {"a": 2e-3})

    t = lambda savers, n: TensorSample("a", savers, 4, True, n)  # noqa: E731
    ok = [sample(x, [t(("a",), 4 * x.tokens), t(("b",), 8 * x.tokens + 4 * x.score_pairs)]) for x in loads]
    graph = fit_block(ok, routed_independent=False)
    assert [x.elements for x in graph.tensors] == [LinearForm(per_token=1), LinearForm(per_token=2, per_score=1)]
    assert graph.op("b").inputs == ("a.1",)  # b saves what a made
    assert graph.op("a").forward_s.at(loads[0]) == pytest.approx(1e-3)
    odd = ok[:-1] + [sample(loads[-1], [t(("a",), 64)])]
    with pytest.raises(ValueError, match="some profiled runs only"):
        fit_block(odd, routed_independent=False)


def test_cli_profile(tmp_path, capsys):
    model_dir = save_tiny("mixtral", tmp_path / "mixtral")
    out = tmp_path / "cost.json"
    assert main(["profile", "--model", str(model_dir), "--tokens", "32,64,128", "--out", str(out), "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert "expert_fc1" in printed and "saved for backward" in printed
    cm = CostModel.load(out)
    assert cm.source == "profiled" and cm.moe_layers == [0, 1]
    with pytest.raises(SystemExit) as bad:
        main(["profile", "--model", str(tmp_path / "none"), "--tokens", "32,64", "--out", str(out)])
    assert bad.value.code != 0 and "--model" in capsys.readouterr().err
