"""The cost model (paper §IV) against hand-computed cases."""

import dataclasses
import math

import pytest

from bagualu_plugin.costmodel import (
    BlockGraph,
    CostModel,
    Forward,
    ForwardKind,
    LinearForm,
    Load,
    MicroBatchCost,
    MitigationOptions,
    ModelDims,
    OpId,
    OpSpec,
    Parallel,
    Roofline,
    TensorSpec,
    crossover,
    footprint,
    iteration_curve,
    one_f_one_b,
)
from bagualu_plugin.costmodel.mitigation import Region, recompute_regions
from bagualu_plugin.costmodel.roofline import fp8_roofline, offload_roofline
from bagualu_plugin.hardware import HardwareSpec, preset

# ---------------------------------------------------------------- 1F1B schedule and stage peaks


def test_schedule_matches_nanotron_1f1b_order():
    steps = one_f_one_b(pp=4, rank=1, micro_batches=6)
    assert [f"{s.kind}{s.micro_batch}" for s in steps] == (
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5".split()
    )
    assert [s.phase for s in steps] == ["warmup"] * 2 + ["steady"] * 8 + ["cooldown"] * 2


@pytest.mark.parametrize(
    "pp, rank, m, in_flight",
    [(4, 0, 8, 4), (4, 1, 8, 3), (4, 3, 8, 1), (8, 0, 32, 8), (8, 0, 3, 3), (1, 0, 5, 1), (2, 0, 1, 1)],
)
def test_uniform_stage_peak_is_in_flight_times_dm(pp, rank, m, in_flight):
    """Rank r of P holds min(P - r, m) micro-batches at its peak (warmup P-r-1, plus one steady F)."""
    cost = MicroBatchCost(forward_s=1.0, backward_s=2.0, activation_bytes=10.0)
    curve = iteration_curve([cost] * m, pp, rank, base_bytes=100.0)
    assert curve.peak_bytes == 100.0 + 10.0 * in_flight
    assert curve.in_flight_at_peak == in_flight
    assert curve.peak_time == in_flight * 1.0  # the first `in_flight` forwards run back to back
    assert curve.peak_step.micro_batch == in_flight - 1
    assert curve.bytes[-1] == 100.0  # everything is released by the end
    assert curve.times[-1] == m * 3.0


def test_uneven_micro_batches_peak_on_the_spike():
    # P=4, r=0: F0 F1 F2 | F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 | B5 B6 B7; micro-batch 4 carries 5 bytes.
    dm = [1, 1, 1, 1, 5, 1, 1, 1]
    costs = [MicroBatchCost(1.0, 2.0, x) for x in dm]
    curve = iteration_curve(costs, pp=4, rank=0)
    # after F3: 4; B0: 3; F4: 3 + 5 = 8
    assert curve.peak_bytes == 8
    assert curve.peak_step.micro_batch == 4 and curve.peak_step.phase == "steady"
    assert curve.peak_time == 4 * 1.0 + 2.0 + 1.0
    assert curve.in_flight_at_peak == 4


def test_uneven_warmup_spike_peaks_before_steady():
    costs = [MicroBatchCost(1.0, 1.0, x) for x in [1, 5, 1, 1, 1, 1]]
    curve = iteration_curve(costs, pp=4, rank=0)
    # F0..F3 = 8 at t=4; afterwards each F replaces a released micro-batch of >= its size
    assert (curve.peak_bytes, curve.peak_time, curve.peak_step.micro_batch) == (8, 4.0, 3)
    assert curve.bytes == [0, 1, 6, 7, 8, 7, 8, 3, 4, 3, 2, 1, 0]


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        one_f_one_b(4, 4, 8)
    with pytest.raises(ValueError, match="micro_batches"):
        one_f_one_b(4, 0, 0)


# ---------------------------------------------------------------- roofline (§IV-B)


def test_roofline_knee_and_shape():
    r = Roofline(launch_s=1e-3, peak=10e9)
    assert r.knee == 10e6
    assert r.bandwidth(1e6) == pytest.approx(1e9)  # launch-bound: s / t0
    assert r.bandwidth(10e6) == pytest.approx(10e9)
    assert r.bandwidth(1e9) == pytest.approx(10e9)  # flat at the peak above the knee
    assert r.time(0) == 0


def test_roofline_crossover():
    i = Roofline(launch_s=1e-3, peak=10e9)  # S_i = 10 MB, B_i = 10 GB/s
    j = Roofline(launch_s=5e-3, peak=100e9)  # S_j = 500 MB, B_j = 100 GB/s
    p1 = crossover(i, j)
    # i is flat at B_i and j rises as s * B_j / S_j: equal at S_j * B_i / B_j = 50 MB
    # (the paper writes S_i * B_j / B_i with i naming the strategy that wins large sizes)
    assert p1 == pytest.approx(j.knee * i.peak / j.peak) == pytest.approx(50e6)
    assert i.bandwidth(p1) == pytest.approx(j.bandwidth(p1))
    assert i.bandwidth(p1 / 2) > j.bandwidth(p1 / 2)
    assert i.bandwidth(p1 * 2) < j.bandwidth(p1 * 2)
    assert crossover(j, i) == p1  # order of arguments does not matter
    assert crossover(Roofline(5e-3, 10e9), j) is None  # slower launch and lower peak: never wins
    assert crossover(Roofline(1e-3, 100e9), j) is None  # same peak


def _hw(**overrides) -> HardwareSpec:
    """Round numbers that make the hand computations below easy to follow."""
    base = dict(
        name="test",
        peak_flops=1e12,
        capacity_bytes=1 << 30,
        hbm_bandwidth=1e10,
        host_link_bandwidth=1e9,
        intra_node_bandwidth=1e9,
        inter_node_bandwidth=1e9,
        devices_per_node=1,
        kernel_launch_s=1e-6,
        copy_launch_s=1e-3,
    )
    return HardwareSpec(**{**base, **overrides})


def test_strategy_rooflines():
    hw = _hw()
    off = offload_roofline(hw)  # copy out + copy back
    assert off.peak == 0.5e9 and off.launch_s == 2e-3 and off.knee == 1e6
    fp8 = fp8_roofline(hw, dtype_bytes=2, block_size=128)
    r = (1 + 4 / 128) / 2
    assert fp8.peak == pytest.approx(1e10 * (1 - r) / (2 * (1 + r)))
    size = 64e6  # well above both knees: saved bytes over quantize + dequantize time
    assert fp8.bandwidth(size) == pytest.approx(size * (1 - r) / (2 * size * (1 + r) / 1e10))


# ---------------------------------------------------------------- mitigation of one op


def _block() -> BlockGraph:
    """x -> a -> y -> b -> z -> c; fp32 tensors of 1000 elements per token.

    a saves x (block input) and its internal w; b saves y (produced by a); c saves z and y;
    i (int64 indices) is produced and saved by c.
    """
    per = LinearForm(per_token=1000)
    t = lambda name, producer, savers, el=per, nbytes=4, fl=True: TensorSpec(name, producer, savers, el, nbytes, fl)  # noqa: E731
    return BlockGraph(
        "moe",
        ops=(
            OpSpec("a", ("x",), LinearForm(per_token=1e-6), LinearForm(per_token=2e-6)),
            OpSpec("b", ("y",), LinearForm(per_token=3e-6), LinearForm(per_token=6e-6)),
            OpSpec("c", ("z", "y"), LinearForm(const=1e-3), LinearForm(const=2e-3)),
        ),
        tensors=(
            t("x", "input", ("a",)),
            t("w", "a", ("a",)),
            t("y", "a", ("b", "c")),
            t("z", "b", ("c",)),
            t("i", "c", ("c",), LinearForm(per_token=10), 8, False),
        ),
    )


T = 100
LOAD = Load(tokens=T, routed=0, score_pairs=T * T, positions=T)
FULL = 1000 * T * 4  # bytes of one fp32 tensor at T tokens: 400 kB


def test_keep_counts_each_storage_once():
    fp = footprint(_block(), {}, LOAD, _hw())
    assert fp.device_bytes == 4 * FULL + 10 * T * 8  # y is saved twice but stored once
    assert (fp.host_bytes, fp.forward_extra_s, fp.backward_extra_s) == (0, 0, 0)


def test_recompute_one_op_drops_its_internals_and_adds_its_forward():
    fp = footprint(_block(), {"a": "recompute"}, LOAD, _hw())
    # region {a}: w (internal) dropped; x held as the region input; y is saved by b and c
    assert fp.device_bytes == 3 * FULL + 10 * T * 8
    assert fp.backward_extra_s == pytest.approx(1e-6 * T)
    assert fp.forward_extra_s == 0


def test_recompute_run_keeps_only_region_inputs():
    fp = footprint(_block(), {"a": "recompute", "b": "recompute", "c": "recompute"}, LOAD, _hw())
    assert fp.device_bytes == FULL  # M0: only the block input x
    assert fp.backward_extra_s == pytest.approx(1e-6 * T + 3e-6 * T + 1e-3)


def test_recompute_through_a_span_replays_it_and_drops_only_the_recomputed_ops_saves():
    block = dataclasses.replace(_block(), units=(("a",),), spans=(("a", "b", "c"),))
    # c alone: the span replays a, b, c from x; z (made by b) and i go, y stays for b
    fp = footprint(block, {"c": "recompute"}, LOAD, _hw())
    assert fp.device_bytes == 3 * FULL
    assert fp.backward_extra_s == pytest.approx(1e-6 * T + 3e-6 * T + 1e-3)
    # a span takes over the units inside it: one region, one replay
    plan = {"a": "recompute", "c": "recompute"}
    assert recompute_regions(block, plan) == [Region(("a", "b", "c"), ("a", "c"))]
    fp = footprint(block, plan, LOAD, _hw())
    assert fp.device_bytes == 2 * FULL  # x held, y kept by b
    assert fp.backward_extra_s == pytest.approx(1e-6 * T + 3e-6 * T + 1e-3)


def test_offload_of_one_op():
    hw = _hw()
    fp = footprint(_block(), {"b": "offload", "c": "offload"}, LOAD, hw)
    # y (both savers offload) and z and i leave the device; one copy each way per storage
    assert fp.device_bytes == 2 * FULL
    assert fp.host_bytes == 2 * FULL + 10 * T * 8
    copy = lambda n: max(1e-3, n / 1e9)  # noqa: E731
    expected = 2 * copy(FULL) + copy(10 * T * 8)
    assert fp.forward_extra_s == pytest.approx(expected)
    assert fp.backward_extra_s == pytest.approx(expected)


def test_offload_minimum_size_keeps_small_tensors():
    fp = footprint(_block(), {"c": "offload"}, LOAD, _hw(), MitigationOptions(offload_min_bytes=FULL))
    # z (400 kB) goes, i (8 kB) stays; y stays on the device because b keeps it there, so c's
    # offload of y buys nothing and copies nothing (case 2 of §V-A)
    assert fp.host_bytes == FULL
    assert fp.device_bytes == 4 * FULL + 10 * T * 8 - FULL


def test_fp8_of_one_op_stores_payload_plus_block_scales():
    hw = _hw()
    fp = footprint(_block(), {"b": "fp8"}, LOAD, hw, MitigationOptions(fp8_block_size=128))
    elements = 1000 * T
    stored = elements + 4 * math.ceil(elements / 128)
    # y: b wants FP8 but c keeps FP32: the runtime keeps the one FP32 copy for both (case 1 of
    # §V-A), so b's FP8 buys nothing and costs nothing
    assert fp.device_bytes == 4 * FULL + 10 * T * 8
    assert fp.forward_extra_s == 0
    fp = footprint(_block(), {"b": "fp8", "c": "fp8"}, LOAD, hw, MitigationOptions(fp8_block_size=128))
    # y and z in FP8; i is an integer tensor and stays
    assert fp.device_bytes == 2 * FULL + 2 * stored + 10 * T * 8
    cast = max(1e-6, (FULL + stored) / 1e10)
    assert fp.forward_extra_s == pytest.approx(2 * cast)
    assert fp.backward_extra_s == pytest.approx(2 * cast)


def test_mitigation_cost_of_each_strategy_on_one_op():
    cm = CostModel({0: _block()}, _hw(), pairs_per_token=0)
    rec = cm.mitigation_cost(OpId(0, "a"), "recompute", Forward(T))
    assert (rec.bytes_saved, rec.forward_s, rec.backward_s) == (FULL, 0, pytest.approx(1e-6 * T))
    off = cm.mitigation_cost(OpId(0, "a"), "offload", Forward(T))
    # x and w go to the host; y is not a's to move
    assert off.bytes_saved == 2 * FULL
    assert off.forward_s == off.backward_s == pytest.approx(2 * max(1e-3, FULL / 1e9))
    assert off.bandwidth == pytest.approx(2 * FULL / (4 * max(1e-3, FULL / 1e9)))
    f8 = cm.mitigation_cost(OpId(0, "a"), "fp8", Forward(T), options=MitigationOptions(fp8_block_size=128))
    stored = 1000 * T + 4 * math.ceil(1000 * T / 128)
    assert f8.bytes_saved == 2 * (FULL - stored)
    keep = cm.mitigation_cost(OpId(0, "c"), "keep", Forward(T))
    assert (keep.bytes_saved, keep.forward_s, keep.backward_s) == (0, 0, 0)
    # relative to a base plan: once c offloads y, offloading b as well frees y from the device
    both = cm.mitigation_cost(OpId(0, "b"), "offload", Forward(T), base={OpId(0, "c"): "offload"})
    assert both.bytes_saved == FULL


def test_plan_errors_name_the_problem():
    with pytest.raises(KeyError, match="lacks"):
        footprint(_block(), {"nope": "keep"}, LOAD, _hw())
    with pytest.raises(ValueError, match="unknown strategies"):
        footprint(_block(), {"a": "zip"}, LOAD, _hw())
    with pytest.raises(ValueError, match="unknown tensors"):
        BlockGraph("moe", (OpSpec("a", ("ghost",), LinearForm(), LinearForm()),), ())


# ---------------------------------------------------------------- analytic model from dimensions


def _tiny(**kw) -> ModelDims:
    base = dict(
        family="qwen3_moe",
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=32,
        dtype="fp32",
    )
    return ModelDims(**{**base, **kw})


def test_grouped_mm_experts_match_the_measured_bytes():
    """docs/architecture.md measured the grouped_mm experts at 1052 * S + 32 bytes (H=64, I=32,
    8 experts, fp32): gathered tokens, gate/up output, SiLU, product, down output, weights and
    three index vectors per pair, plus the int32 offsets."""
    cm = CostModel.from_config(_tiny(), preset("cpu"))
    block = cm.blocks[0]
    experts = [t for t in block.tensors if block.owner(t) in ("expert_fc1", "expert_act", "expert_fc2")]
    for s in (10, 100, 1000):
        load = Load(tokens=50, routed=s, score_pairs=2500, positions=50)
        assert sum(t.bytes(load) for t in experts) == 1052 * s + 32


def test_activation_bytes_linear_in_tokens_and_routed_pairs():
    cm = CostModel.from_config(_tiny(), preset("cpu"))
    a = [cm.activation_bytes(t, routed=0) for t in (100, 200, 300)]
    assert a[2] - a[1] == a[1] - a[0] > 0  # sdpa: linear in T
    r = [cm.activation_bytes(100, routed=s) for s in (0, 100, 200)]
    per_pair = (r[2] - r[1]) / 100
    assert per_pair == (r[1] - r[0]) / 100 == 4 * 1052  # 4 MoE layers of 1052 bytes per pair
    assert cm.activation_bytes(100) == cm.activation_bytes(100, routed=100 * 2)  # None: T * top_k


def test_eager_attention_is_quadratic_in_sequence_length():
    cm = CostModel.from_config(_tiny(attention="eager"), preset("cpu"))
    one_seq = cm.activation_bytes(256, seq_len=256)  # one sequence of 256
    four_seq = cm.activation_bytes(256, seq_len=64)  # four sequences of 64
    # probabilities: heads x L x L fp32 per sequence and layer (fp32 model: one copy); RoPE's
    # cos and sin tables (head_dim per position) are shared by the sequences; the loss's targets
    # of one sequence are a view of its padded labels, one int64 more
    assert one_seq - four_seq == 4 * 4 * 4 * (256 * 256 - 4 * 64 * 64) + 2 * 16 * (256 - 64) * 4 + 8


def test_routed_per_layer_and_errors():
    cm = CostModel.from_config(_tiny(), preset("cpu"))
    base = cm.activation_bytes(100)
    spiked = cm.activation_bytes(100, routed=[200, 200, 200, 520])
    assert spiked - base == 320 * 1052
    with pytest.raises(ValueError, match="one per MoE layer"):
        cm.activation_bytes(100, routed=[1, 2])
    with pytest.raises(ValueError, match="tokens"):
        cm.activation_bytes(-1)
    with pytest.raises(ValueError, match="seq_len"):
        cm.activation_bytes(100, seq_len=30)


def test_full_recompute_keeps_one_block_input_per_layer():
    dims = _tiny(dtype="bf16")
    cm = CostModel.from_config(dims, preset("cpu"))
    m0 = cm.activation_bytes(100, plan=cm.full_recompute())
    # every decoder layer holds its input (T x H bf16); the embedding nothing; the head's final
    # norm holds its input and the LM head with the loss (the loss runner) the final norm's
    # output (two T x H bf16) and the int64 labels
    head = 2 * 100 * 64 * 2 + 100 * 8
    # the embedding's checkpoint holds the token ids; RoPE's cos/sin stay (shared by every
    # layer); the layers' checkpoints hold the position ids
    embed = 100 * 8 + 2 * 100 * 16 * 2 + 100 * 8
    assert m0 == dims.num_layers * 100 * 64 * 2 + head + embed
    assert m0 < cm.activation_bytes(100) / 5


def test_op_costs_sum_to_activation_bytes():
    cm = CostModel.from_config(_tiny(dtype="bf16", shared_expert_intermediate_size=48, family="glm4_moe"), preset("h100"))
    rows = cm.op_costs(Forward(300, 100, 700))
    assert sum(r.saved_bytes for r in rows) == pytest.approx(cm.activation_bytes(300, routed=700, seq_len=100))
    assert {r.op.name for r in rows if r.op.layer == 0} >= {"attn_norm", "router", "expert_fc1", "shared_expert"}
    assert all(r.forward_s > 0 and r.backward_s == pytest.approx(2 * r.forward_s) for r in rows)


def test_tensor_parallel_splits_per_token_terms():
    dims = _tiny(dtype="bf16")
    one = CostModel.from_config(dims, preset("h100"))
    two = CostModel.from_config(dims, preset("h100"), Parallel(dp=2, tp=2, ep=1))
    # with no routed pairs, every remaining per-token term is split by tp (ids and RoPE excepted)
    a1, a2 = one.activation_bytes(1000, routed=0), two.activation_bytes(1000, routed=0)
    emb = sum(t.bytes(Load(1000, 0, 1e6, 1000)) for t in one.blocks[-1].tensors if not t.held_by)
    # + loss targets (one sequence: its padded labels) and divisor + int32 offsets of 8 experts x 4 layers
    unsplit = emb + 1001 * 8 + 4 + 4 * 8 * 4
    assert a2 == pytest.approx((a1 - unsplit) / 2 + unsplit)
    assert two.pairs_per_token == 1.0  # top_k / tp: sequence-parallel tokens are split too


def test_stage_split_and_static_bytes():
    cm = CostModel.from_config(_tiny(num_layers=8, first_k_dense=2, dense_intermediate_size=96), preset("h100"))
    first, last = cm.stage(4, 0), cm.stage(4, 3)
    assert list(first.blocks) == [-1, 0, 1] and first.moe_layers == []
    assert list(last.blocks) == [-1, 6, 7, 8] and last.moe_layers == [6, 7]
    # a later stage makes its layers' RoPE tables and position ids, and has no token ids or embedding
    assert {t.name for t in last.blocks[-1].tensors} == {t.name for t in first.blocks[-1].tensors} - {"embed.ids"}
    assert last.blocks[-1].dense_params == 0 < first.blocks[-1].dense_params
    with pytest.raises(ValueError, match="evenly"):
        cm.stage(3, 0)
    dense, expert = last.parameter_counts()
    assert expert == 2 * (8 * 3 * 64 * 32 + 8 * 64)  # two MoE layers of 8 experts plus routers
    assert last.static_bytes(2, 4, 12, dense_shards=4, expert_shards=2) == round(
        dense * (6 + 12 / 4) + expert * (6 + 12 / 2)
    )


def test_save_load_round_trip(tmp_path):
    dims = _tiny(family="deepseek_v3", mla=dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16))
    cm = CostModel.from_config(dims, "h200", Parallel(dp=2, ep=2))
    cm.save(tmp_path / "cost.json")
    back = CostModel.load(tmp_path / "cost.json")
    plan = {OpId(1, "expert_fc1"): "offload", OpId(2, "attn_core"): "fp8", OpId(3, "router"): "recompute"}
    for model in (cm, back):
        assert model.hardware == cm.hardware
    assert back.micro_batch(Forward(300, 100), plan=plan) == cm.micro_batch(Forward(300, 100), plan=plan)
    assert back.op_costs(Forward(300, None, [50, 60, 70, 80])) == cm.op_costs(Forward(300, None, [50, 60, 70, 80]))
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a cost model file"):
        CostModel.load(tmp_path / "bad.json")


def test_from_config_rejects_inconsistent_layouts():
    with pytest.raises(ValueError, match="ep"):
        CostModel.from_config(_tiny(), "cpu", Parallel(dp=3, ep=3))
    with pytest.raises(ValueError, match="tp"):
        CostModel.from_config(_tiny(), "cpu", Parallel(tp=3))
    with pytest.raises(ValueError, match="unknown hardware preset"):
        CostModel.from_config(_tiny(), "tpu")


def test_cast_roofline_uses_measured_knees_where_given():
    from bagualu_plugin.costmodel.roofline import cast_kernel

    cpu, h100 = preset("cpu"), preset("h100")
    assert (cast_kernel(cpu).peak, cast_kernel(cpu).launch_s) == (cpu.cast_bandwidth, cpu.cast_launch_s)
    assert (cast_kernel(h100).peak, cast_kernel(h100).launch_s) == (h100.hbm_bandwidth, h100.kernel_launch_s)


def test_fsdp_static_bytes_shard_everything_and_gather_two_layers():
    """Under FSDP full shard every parameter's weights, gradients and optimizer state are divided
    over the shards, and two decoder layers' weights are whole (running and prefetched)."""
    cm = CostModel.from_config(_tiny(num_layers=8, first_k_dense=2, dense_intermediate_size=96), preset("h100"))
    dense, expert = cm.parameter_counts()
    layer = max(cm.blocks[i].dense_params + cm.blocks[i].expert_params for i in cm.layers)
    assert layer == cm.blocks[2].dense_params + cm.blocks[2].expert_params  # an MoE layer is the largest
    assert cm.fsdp_static_bytes(2, 2, 8, shards=16) == round((dense + expert) * 12 / 16 + 2 * layer * 2)


def test_fsdp_with_expert_parallelism_is_refused():
    from bagualu_plugin.config import Recipe, RecipeError, load_recipe

    data = load_recipe("qwen3_moe").model_dump()
    data["budget"]["fsdp"] = True
    with pytest.raises(RecipeError, match=r"budget\.fsdp: FSDP shards the experts itself: parallel\.ep must be 1, got 8"):
        Recipe.from_dict(data)


@pytest.mark.parametrize(
    ("family", "config"),
    [
        ("qwen3_moe", {}), ("qwen3_moe", {"attention_bias": True}), ("qwen2_moe", {}), ("qwen2_moe", {"qkv_bias": False}),
        ("deepseek_v3", {"attention_bias": True}), ("deepseek_v3", {"attention_bias": True, "q_lora_rank": None}),
        ("glm4_moe", {}), ("glm4_moe", {"attention_bias": True}), ("mixtral", {}), ("gpt_oss", {}),
    ],
)
def test_parameters_counted_are_the_models(family, config):
    """The parameters the static bytes are priced from (`CostModel.parameter_counts`, per block)
    and the model's total (`param_count`) are the checkpoint's own: biases where its config
    gives them (GLM-4.5's q/k/v, Qwen2-MoE's, gpt-oss's, its experts' and router's), sinks, the
    shared expert's gate, the final norm once."""
    from bagualu_plugin.adapters import tiny_model
    from bagualu_plugin.costmodel.dims import param_count

    model = tiny_model(family, num_hidden_layers=3, **config)
    dims = ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa")
    real = sum(p.numel() for p in model.parameters())
    assert sum(CostModel.from_config(dims, "cpu").parameter_counts()) == param_count(dims) == real


def test_a_forward_is_one_hashable_value_whatever_form_its_routing_takes():
    by_layer = Forward(32, 16, {3: 5.0, 1: 7.0})  # by layer: kept in layer order
    assert by_layer.routed == (7.0, 5.0) and by_layer == Forward(32, 16, [7.0, 5.0])
    assert hash(by_layer) == hash(Forward(32, 16, (7.0, 5.0))) and Forward(32, 16, 4).routed == 4
    assert by_layer != Forward(32, 16, [7.0, 5.0], ForwardKind(masked=True))
    assert str(Forward(32, 16, kind=ForwardKind(masked=True))) == "32 tokens of length 16 (masked attention)"
