"""Sharding engines under the Trainer (`integrations.engines`): accelerate's real FSDP plugin and
DeepSpeed's JSON configs read into the budget fields that price each rank's weights, gradients and
optimizer state, what is refused by name, and the static bytes each engine leaves a rank. On CPU
the Trainer's own `fsdp` arguments get DistributedDataParallel over gloo from accelerate: training
arguments that ask for an engine that does not run are named in a warning. (DeepSpeed does run
under the Trainer on CPU when `accelerate launch` enables it: `tests/test_deepspeed.py`.)"""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from helpers import tiny_recipe
from transformers import TrainingArguments

from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.config import RecipeError
from bagualu_plugin.integrations.engines import (
    engine,
    engine_budget,
    fsdp_budget,
    parameter_bytes,
    trainer_budget,
    zero_budget,
    zero_buffer_bytes,
    zero_widths,
)
from bagualu_plugin.stage import Stage

OFF = {"offload_optimizer": False, "offload_params": False}


def test_fsdp2_full_shard_and_its_cpu_offload():
    assert fsdp_budget(FullyShardedDataParallelPlugin(fsdp_version=2)) == {"fsdp": True, "shard_optimizer": True, **OFF}
    offloaded = fsdp_budget(FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True))
    assert offloaded["offload_params"] and offloaded["offload_optimizer"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"fsdp_version": 1}, "fsdp_version=1"),
        ({"fsdp_version": 2, "activation_checkpointing": True}, "activation_checkpointing=True"),
        ({"fsdp_version": 2, "reshard_after_forward": False}, "reshard_after_forward=False"),
    ],
)
def test_fsdp_settings_it_cannot_price_are_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=f"FSDP: {named}"):
        fsdp_budget(FullyShardedDataParallelPlugin(**fields))


BUCKETS = 500_000_000 * 4  # one reduce bucket of DeepSpeed's default size, FP32


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        ({}, {"fsdp": False, "shard_optimizer": False, "shard_gradients": False, **OFF, "engine_buffer_bytes": 0}),
        ({"stage": 1}, {"fsdp": False, "shard_optimizer": True, "shard_gradients": False, **OFF, "engine_buffer_bytes": BUCKETS}),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}},
         {"fsdp": False, "shard_optimizer": True, "shard_gradients": True, "offload_optimizer": True, "offload_params": False,
          "engine_buffer_bytes": BUCKETS}),
        ({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "none"}},
         {"fsdp": True, "shard_optimizer": True, "shard_gradients": True, "offload_optimizer": False, "offload_params": True,
          "engine_buffer_bytes": BUCKETS}),
    ],
)
def test_zero_stages_and_offload(zero, expected):
    assert zero_budget({"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto"}) == expected


@pytest.mark.parametrize(
    ("config", "buffers"),
    [
        ({"stage": 2, "reduce_bucket_size": 1000}, 4000),
        ({"stage": 2, "reduce_bucket_size": 1000, "overlap_comm": True}, 8000),  # two, taking turns
        ({"stage": 2, "reduce_bucket_size": 1000, "contiguous_gradients": False}, 0),  # none: each gradient on its own
        ({"stage": 3, "reduce_bucket_size": 1000, "overlap_comm": True}, 4000),  # stage 3's one bucket overlaps anyway
        ({"stage": 1, "reduce_bucket_size": "auto"}, 64 * 64 * 4),  # the Trainer's and accelerate's fill: hidden_size squared
        ({"stage": 2, "reduce_bucket_size": 5e8}, BUCKETS),
    ],
)
def test_zero_reduce_buckets(config, buffers):
    assert zero_buffer_bytes({"zero_optimization": config}, hidden_size=64) == buffers
    assert zero_buffer_bytes({"zero_optimization": config, "bf16": {"enabled": True}}, hidden_size=64) == buffers // 2
    assert zero_buffer_bytes({"zero_optimization": config, "fp16": {"enabled": "auto"}}, hidden_size=64) == buffers  # the larger


def test_zero_buckets_in_the_communication_dtype_at_stage_3():
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}, "bf16": {"enabled": True}}
    assert zero_buffer_bytes({**config, "communication_data_type": "fp32"}) == 4000
    below = {**config, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}
    assert zero_buffer_bytes({**below, "communication_data_type": "fp32"}) == 2000  # stage 2's buckets: the weights' dtype


@pytest.mark.parametrize(
    ("precision", "param_bytes", "stage", "widths"),
    [
        ({"bf16": {"enabled": True}}, 4, 2, {}),  # cast to 2 bytes, FP32 gradients and master: the defaults
        ({"fp16": {"enabled": True}}, 2, 3, {}),
        ({"bf16": {"enabled": "auto"}}, 4, 2, {"weight_bytes_per_param": 4}),  # not filled yet: the wider
        ({}, 4, 2, {"weight_bytes_per_param": 4, "optimizer_bytes_per_param": 8}),  # FP32: the weights are the master
        ({"bf16": {"enabled": False}}, 4, 0, {"weight_bytes_per_param": 4, "optimizer_bytes_per_param": 8}),
        ({}, 4, 3, {"weight_bytes_per_param": 4, "optimizer_bytes_per_param": 12}),  # stage 3 keeps an FP32 partition beside
        ({}, 2, 2, {"weight_bytes_per_param": 2, "optimizer_bytes_per_param": 12}),  # BF16 weights, an FP32 master
    ],
)
def test_zero_prices_the_weights_and_optimizer_state_in_the_widths_deepspeed_keeps(precision, param_bytes, stage, widths):
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 1000}, **precision}
    assert zero_widths(config, param_bytes) == widths
    assert zero_budget(config, param_bytes=param_bytes).items() >= widths.items()
    assert not zero_budget(config).keys() & {"weight_bytes_per_param", "optimizer_bytes_per_param"}  # no model: the defaults


def test_a_models_parameter_width_is_what_most_of_its_parameters_have():
    assert parameter_bytes(tiny_model("qwen3_moe", num_hidden_layers=1)) == 4
    model = tiny_model("qwen3_moe", num_hidden_layers=1, dtype=torch.bfloat16)
    assert parameter_bytes(model) == 2
    model.model.norm.weight.data = model.model.norm.weight.data.float()  # a few FP32 ones (norms kept in FP32)
    assert parameter_bytes(model) == 2
    for p in model.parameters():  # ZeRO-3's partitions: the parameters empty, their whole size in ds_numel
        p.ds_numel, p.data = p.numel(), p.data.new_empty(0)
    assert parameter_bytes(model) == 2


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage=4: expected one of \(0, 1, 2, 3\)"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
         "zero_optimization.offload_param needs stage 3, got stage 2"),
        ({"zero_optimization": {"stage": 3}, "activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, "reduce_bucket_size='auto': pass the model's hidden_size"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, "reduce_bucket_size='big': expected a positive number"),
    ],
)
def test_zero_settings_it_cannot_price_are_refused_by_name(config, named):
    with pytest.raises(ValueError, match=f"DeepSpeed: (zero_optimization.)?{named}"):
        zero_budget(config)


def test_each_engine_leaves_a_rank_its_share():
    """Static bytes per rank of 2: weights W, gradients G and optimizer state O per trainable
    parameter; ZeRO-1 divides O, ZeRO-2 G and O, ZeRO-3 (= FSDP2) all three plus two gathered
    layers' weights; offload takes what the host keeps off the device; ZeRO adds its reduce
    buckets (B)."""
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    base = tiny_recipe(model, seq_len=16, micro_batch_size=1, parallel={"dp": 2}, pipeline={"pp": 1, "micro_batches": 1},
                       budget={"non_activation_bytes": "auto"})

    def static(**budget) -> int:
        return Stage.of(base.model_copy(update={"budget": base.budget.model_copy(update=budget)})).static_bytes

    cost = Stage.of(base).cost
    params, trained = sum(cost.parameter_counts()), sum(cost.parameter_counts(trainable=True))
    w, g, o = base.budget.weight_bytes_per_param, base.budget.grad_bytes_per_param, base.budget.optimizer_bytes_per_param
    layer = max(cost.blocks[i].dense_params + cost.blocks[i].expert_params for i in cost.layers)
    assert static(shard_optimizer=False) == round(params * w + trained * (g + o))
    b = 4 * 1000

    def zero(stage: int, **fields) -> dict:
        return zero_budget({"zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, **fields}})

    assert static(**zero(1)) == round(params * w + trained * (g + o / 2)) + b
    assert static(**zero(2)) == round(params * w + trained * (g + o) / 2) + b
    assert static(**zero(2, offload_optimizer={"device": "cpu"})) == round(params * w) + b
    full = round((params * w + trained * (g + o)) / 2 + 2 * layer * w)
    assert static(**zero(3)) == full + b
    assert static(**fsdp_budget(FullyShardedDataParallelPlugin(fsdp_version=2))) == full
    assert static(**fsdp_budget(FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True))) == round(2 * layer * w)
    with pytest.raises(RecipeError, match="budget.offload_params: weight shards in host memory need budget.fsdp"):
        tiny_recipe(model, seq_len=16, micro_batch_size=1, pipeline={"pp": 1, "micro_batches": 1}, budget={"offload_params": True})


@pytest.mark.parametrize("asked", ["arguments", "launch"])
def test_asking_for_fsdp_on_cpu_is_said_and_ddp_priced(tmp_path, monkeypatch, asked):
    """accelerate's CPU state runs no FSDP or DeepSpeed (`fsdp_plugin`, `deepspeed_plugin` None),
    whether the Trainer's arguments or `accelerate launch`'s config (the flag its launcher sets)
    asked for it: the plugin says which asked and prices what runs, on the Trainer's path and on
    the Accelerate path (which has no arguments of its own, only the launch's)."""
    if asked == "arguments":
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp=True, fsdp_config={"fsdp_version": 2}, report_to=[])
        said = "the training arguments' fsdp"
    else:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
        said = "accelerate launch's ACCELERATE_USE_FSDP"
    state = Accelerator(cpu=True).state
    with pytest.warns(RuntimeWarning, match=rf"bagualu: {said} asks for a sharding engine, but accelerate runs NO .*what runs"):
        assert trainer_budget(args, state) == {}
    assert engine(state) is None
    if asked == "launch":
        with pytest.warns(RuntimeWarning, match=rf"bagualu: {said} asks for a sharding engine"):
            assert engine_budget(state) == {}
    else:
        assert engine_budget(state) == {}
    assert not torch.distributed.is_initialized()
