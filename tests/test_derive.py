"""`bgl.derive_recipe`: the recipe of a live model, derived from the model, the device and the
launcher, with what the user gives winning; `bagualu recipe` prints it; bad input names the field."""

from __future__ import annotations

import pytest
import torch
import yaml

import bagualu_plugin as bgl
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.adapters.tiny import save_tiny
from bagualu_plugin.cli import main
from bagualu_plugin.costmodel import ModelDims
from bagualu_plugin.derive import preset_for

CAPACITY = {"hardware": {"capacity_bytes": "1GiB"}}
_TINY = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "num_experts": 8, "top_k": 2, "moe_intermediate_size": 32,
         "dtype": "fp32"}
# The model section a user writes for each tiny model as recipes/bagualu/ does, from its config.json
# (adapters/tiny.py): GLM-4 rotates half of each head (partial_rotary_factor 0.5) and renormalises
# its top-k weights; DeepSeek-V3's attention is latent (MLA); Qwen2-MoE's shared expert is 48 wide,
# its q/k/v biased; Mixtral renormalises; gpt-oss alternates sliding and full attention, eager, its
# RoPE table half-width, its projections biased.
SECTIONS = {
    "glm4_moe": {**_TINY, "num_layers": 3, "num_key_value_heads": 2, "head_dim": 16, "shared_expert_intermediate_size": 32,
                 "first_k_dense": 1, "dense_intermediate_size": 96, "norm_topk_prob": True, "partial_rotary": True, "rope_dim": 8},
    "deepseek_v3": {**_TINY, "num_layers": 3, "num_key_value_heads": 4, "head_dim": 8, "shared_expert_intermediate_size": 32,
                    "first_k_dense": 1, "dense_intermediate_size": 96, "norm_topk_prob": True,
                    "mla": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24}},
    "qwen2_moe": {**_TINY, "num_layers": 3, "num_key_value_heads": 2, "head_dim": 16, "shared_expert_intermediate_size": 48,
                  "first_k_dense": 1, "dense_intermediate_size": 96, "attention_bias": True},
    "qwen3_moe": {**_TINY, "num_layers": 3, "num_key_value_heads": 2, "head_dim": 16, "first_k_dense": 1, "dense_intermediate_size": 96,
                  "qk_norm": True},
    "mixtral": {**_TINY, "num_layers": 2, "num_key_value_heads": 2, "head_dim": 16, "norm_topk_prob": True},
    "gpt_oss": {**_TINY, "num_layers": 2, "num_key_value_heads": 2, "head_dim": 16, "rope_dim": 8, "attention": "eager",
                "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True},
}


@pytest.mark.parametrize("family", sorted(SECTIONS))
def test_the_model_section_is_the_one_a_user_writes(family):
    recipe = bgl.derive_recipe(tiny_model(family), CAPACITY)
    assert recipe.model == ModelDims.model_validate({"family": family, **SECTIONS[family]})
    assert (recipe.hardware.name, recipe.hardware.capacity_bytes, recipe.hardware.simulated) == ("cpu", 2**30, True)
    assert (recipe.parallel.dp, recipe.parallel.ep, recipe.pipeline.pp, recipe.pipeline.micro_batches) == (1, 1, 1, 1)


def test_what_the_user_gives_wins_field_by_field(tmp_path):
    model = tiny_model("qwen3_moe")
    given = {**CAPACITY, "pipeline": {"micro_batches": 8}, "batch": {"seq_len": 512}, "strategies": {"allowed": ["recompute"]},
             "model": {"family": "qwen3_moe", "top_k": 2}}  # agreeing with the checkpoint
    recipe = bgl.derive_recipe(model, given)
    assert (recipe.pipeline.micro_batches, recipe.pipeline.pp, recipe.batch.seq_len, recipe.batch.micro_batch_size) == (8, 1, 512, 1)
    assert recipe.strategies.allowed == ["recompute"]
    path = tmp_path / "partial.yaml"
    path.write_text(yaml.safe_dump(given))
    assert bgl.derive_recipe(model, path) == recipe
    assert bgl.derive_recipe(model, recipe) is recipe  # a full recipe is taken whole


def test_training_arguments_give_accumulation_and_shape():
    class Args:  # the fields HF's TrainingArguments and TRL's SFTConfig name
        gradient_accumulation_steps, per_device_train_batch_size, max_length = 4, 2, 96

    recipe = bgl.derive_recipe(tiny_model("qwen3_moe"), CAPACITY, training_args=Args())
    assert (recipe.pipeline.micro_batches, recipe.batch.micro_batch_size, recipe.batch.seq_len) == (4, 2, 96)


def test_a_disagreeing_model_field_names_it_and_both_values():
    with pytest.raises(bgl.RecipeError, match=r"model\.top_k: 4 given, but the qwen3_moe checkpoint \(Qwen3MoeForCausalLM\) has 2"):
        bgl.derive_recipe(tiny_model("qwen3_moe"), {**CAPACITY, "model": {"top_k": 4}})
    full = bgl.derive_recipe(tiny_model("qwen3_moe"), CAPACITY)
    with pytest.raises(bgl.RecipeError, match=r"model\.num_layers: 3 given, .* has 4"):
        bgl.derive_recipe(tiny_model("qwen3_moe", num_hidden_layers=4), full)
    with pytest.raises(bgl.RecipeError, match=r"model\.num_layer: unknown key; expected one of: family, hidden_size"):
        bgl.derive_recipe(tiny_model("qwen3_moe"), {**CAPACITY, "model": {"num_layer": 3}})


def test_on_cpu_the_capacity_must_be_given():
    with pytest.raises(bgl.RecipeError, match=r"hardware\.capacity_bytes: the model is on cpu, which has no device memory"):
        bgl.derive_recipe(tiny_model("qwen3_moe"))
    with pytest.raises(bgl.RecipeError, match=r"hardware\.capacity_bytes"):
        bgl.apply(tiny_model("qwen3_moe"), {"pipeline": {"micro_batches": 2}})
    assert bgl.derive_recipe(tiny_model("qwen3_moe"), {"hardware": "cpu"}).hardware.capacity_bytes == 2**31  # the preset, by name


def test_cuda_devices_map_to_presets():
    assert preset_for("NVIDIA H100 80GB HBM3", 85_045_395_456) == ("h100", None)
    assert preset_for("NVIDIA H200", 150_754_820_096) == ("h200", None)
    assert preset_for("NVIDIA A100-SXM4-80GB", 85_899_345_920) == ("a100", None)
    preset, warning = preset_for("NVIDIA B200", 191_000_000_000)
    assert preset == "h200" and "no hardware preset knows the CUDA device 'NVIDIA B200': using h200's figures (peak" in warning


def test_bagualu_recipe_prints_what_validate_recipe_accepts(tmp_path, capsys):
    save_tiny("glm4_moe", tmp_path / "ckpt", num_hidden_layers=4)
    out = tmp_path / "derived.yaml"
    flags = ["--capacity", "64MiB", "--micro-batches", "4", "--seq-len", "256", "--out", str(out)]
    assert main(["recipe", str(tmp_path / "ckpt"), *flags]) == 0
    data = yaml.safe_load(out.read_text())
    assert data["hardware"] == {"preset": "cpu", "capacity_bytes": 64 * 2**20}
    assert data["pipeline"]["micro_batches"] == 4 and data["batch"] == {"seq_len": 256, "micro_batch_size": 1}
    assert ModelDims.model_validate(data["model"]) == bgl.derive_recipe(tiny_model("glm4_moe", num_hidden_layers=4), CAPACITY).model
    capsys.readouterr()
    assert main(["validate-recipe", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {out} (glm4_moe, 1 devices of cpu")
    with pytest.raises(SystemExit, match=r"give --capacity"):
        main(["recipe", str(tmp_path / "ckpt")]) if not torch.cuda.is_available() else pytest.skip("a CUDA device has memory")
