"""nanotron's Config with a `bagualu:` section: YAML loading with nanotron's own loader, the
save/reload round trip, the recipe it implies, and each bad config as an error naming the fields."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytest.importorskip("nanotron")

from nanotron_configs import config_dict, load  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bagualu_plugin.adapters.costs import model_dims  # noqa: E402
from bagualu_plugin.adapters.tiny import save_tiny  # noqa: E402
from bagualu_plugin.config import RecipeError  # noqa: E402
from bagualu_plugin.integrations.nanotron import compat  # noqa: E402
from bagualu_plugin.integrations.nanotron.config import Config, recipe_for  # noqa: E402

nt_config = compat.import_nanotron()
from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine  # noqa: E402

# The demo recipe's model (recipes/bagualu/demo.yaml), as nanotron's Llama config sees it.
MODEL = {
    "family": "glm4_moe",
    "hidden_size": 128,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 128,
    "num_experts": 32,
    "top_k": 8,
    "moe_intermediate_size": 128,
    "dtype": "fp32",
}


def nanotron_dict(pp=2, dp=1, ep=1, seq_len=64, micro_batch_size=1, accumulation=4, bagualu=None) -> dict:
    """The smallest config nanotron 0.4 accepts, with the demo model's Llama-like dimensions."""
    model = {
        "init_method": {"std": 0.02},
        "model_config": {
            "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        },
    }
    sections = {} if bagualu is None else {"bagualu": bagualu}
    shape = {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "accumulation": accumulation}
    return config_dict(model, pp=pp, dp=dp, ep=ep, **shape, **sections)


INLINE = {"enabled": True, "hardware": {"preset": "cpu", "capacity_bytes": "1GB"}, "model": MODEL, "budget": {"non_activation_bytes": 0}}
DEMO = {"enabled": True, "recipe": "demo"}
DEMO_SHAPE = {"pp": 4, "dp": 1, "ep": 4, "seq_len": 128, "accumulation": 4}


def test_without_section_is_stock_nanotron(tmp_path):
    ours, stock = load(tmp_path, nanotron_dict()), load(tmp_path, nanotron_dict(), nt_config.Config)
    assert ours.bagualu is None
    assert isinstance(ours.parallelism.pp_engine, OneForwardOneBackwardPipelineEngine)
    assert {k: v for k, v in ours.as_dict().items() if k != "bagualu"} == stock.as_dict()


@pytest.mark.parametrize("section", [None, INLINE, DEMO], ids=["none", "inline", "recipe"])
def test_save_and_reload(tmp_path, section):
    shape = DEMO_SHAPE if section is DEMO else {}
    config = load(tmp_path, nanotron_dict(**shape, bagualu=section))
    saved = tmp_path / "saved.yaml"
    config.save_as_yaml(str(saved))  # nanotron reloads it with config_class=Config itself
    again = nt_config.get_config_from_file(str(saved), config_class=Config)
    assert again.as_dict() == config.as_dict()
    assert again.bagualu == config.bagualu


def test_recipe_takes_nanotron_sections(tmp_path):
    config = load(tmp_path, nanotron_dict(pp=2, dp=2, ep=2, seq_len=64, micro_batch_size=2, accumulation=3, bagualu=INLINE))
    recipe = recipe_for(config, pp_rank=1, ep_rank=1)
    assert (recipe.pipeline.pp, recipe.pipeline.rank, recipe.pipeline.micro_batches) == (2, 1, 3)
    assert (recipe.batch.seq_len, recipe.batch.micro_batch_size) == (64, 2)
    # nanotron's dp x ep replicas of the dense weights are the recipe's data parallelism
    assert (recipe.parallel.dp, recipe.parallel.tp, recipe.parallel.ep, recipe.parallel.ep_rank) == (4, 1, 2, 1)
    assert recipe.model.hidden_size == 128 and recipe.hardware.capacity_bytes == 10**9


def test_recipe_by_name_agreeing(tmp_path):
    config = load(tmp_path, nanotron_dict(**DEMO_SHAPE, bagualu=DEMO))
    recipe = recipe_for(config, pp_rank=3)
    assert (recipe.pipeline.pp, recipe.pipeline.rank, recipe.parallel.ep) == (4, 3, 4)
    assert recipe.strategies.allowed == ["recompute"]  # the rest of the recipe is kept


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pp": 2}, "bagualu recipe pipeline.pp=4 disagrees with nanotron parallelism.pp=2"),
        ({"accumulation": 8}, "pipeline.micro_batches=4 disagrees with nanotron tokens.batch_accumulation_per_replica=8"),
        ({"seq_len": 256}, "batch.seq_len=128 disagrees with nanotron tokens.sequence_length=256"),
        ({"ep": 2, "dp": 2}, "parallel.ep=4 disagrees with nanotron parallelism.expert_parallel_size=2"),
        ({"dp": 2}, "parallel.dp=4 disagrees with nanotron parallelism.dp x parallelism.expert_parallel_size=8"),
    ],
)
def test_recipe_disagreeing_with_nanotron(tmp_path, change, message):
    with pytest.raises(RecipeError, match=message):
        load(tmp_path, nanotron_dict(**{**DEMO_SHAPE, **change}, bagualu=DEMO))


def test_model_disagreeing_with_nanotron(tmp_path):
    inline = {**INLINE, "model": {**MODEL, "hidden_size": 256, "num_attention_heads": 8}}
    message = r"bagualu\.model\.hidden_size: .*model\.hidden_size=256 disagrees with nanotron model\.model_config\.hidden_size=128"
    with pytest.raises(RecipeError, match=message):
        load(tmp_path, nanotron_dict(bagualu=inline))


def test_overlap_of_all_to_alls_follows_the_fused_points(tmp_path):
    config = load(tmp_path, nanotron_dict(pp=4, bagualu={**INLINE, "dual_batch": True, "overlap_all_to_all": False}))
    assert recipe_for(config, pp_rank=0).pipeline.overlap_all_to_all is False
    with pytest.raises(RecipeError, match=r"bagualu\.overlap_all_to_all: applies to the fused points of bagualu\.dual_batch, which is off"):
        load(tmp_path, nanotron_dict(pp=4, bagualu={**INLINE, "overlap_all_to_all": False}))


def test_unknown_key_in_section(tmp_path):
    with pytest.raises(Exception, match="recompute_everything"):
        load(tmp_path, nanotron_dict(bagualu={**INLINE, "recompute_everything": True}))


def test_unknown_key_in_inline_section(tmp_path):
    with pytest.raises(RecipeError, match=r"bagualu\.budget\.reserve: unknown key"):
        load(tmp_path, nanotron_dict(bagualu={**INLINE, "budget": {"reserve": 0}}))


@pytest.mark.parametrize("owner", ["recompute_layer", "moe_layer_recompute"])
def test_recompute_owned_twice(tmp_path, owner):
    config = load(tmp_path, nanotron_dict(bagualu=INLINE))
    setattr(config.parallelism, owner, True)  # PyPI 0.4 has neither field; main has recompute_layer
    with pytest.raises(RecipeError, match=rf"bagualu\.enabled and parallelism\.{owner} both own recompute"):
        dataclasses.replace(config)


def test_enabled_without_a_checkpoint_needs_the_model(tmp_path):
    with pytest.raises(RecipeError, match=r"bagualu\.model: required: model\.init_method is a random init"):
        load(tmp_path, nanotron_dict(bagualu={"enabled": True, "hardware": {"capacity_bytes": "1GB"}}))


def _checkpoint_dict(tmp_path, bagualu: dict) -> dict:
    """A config training a saved tiny Qwen3-MoE (4 layers) from its checkpoint."""
    save_tiny("qwen3_moe", tmp_path / "ckpt", num_hidden_layers=4)
    data = nanotron_dict(bagualu=bagualu)
    data["model"] = {
        "init_method": {"path": str(tmp_path / "ckpt")},
        "model_config": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128},
    }
    return data


def test_enabled_with_the_capacity_is_a_complete_section(tmp_path):
    """The dimensions come from the checkpoint at model.init_method.path, as bgl.derive_recipe
    reads them off the live model."""
    config = load(tmp_path, _checkpoint_dict(tmp_path, {"enabled": True, "hardware": {"capacity_bytes": "1GB"}}))
    recipe = recipe_for(config, 1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    assert recipe.model == model_dims(model)
    assert (recipe.hardware.name, recipe.hardware.capacity_bytes, recipe.pipeline.rank) == ("cpu", 10**9, 1)


def test_on_cpu_the_capacity_is_needed(tmp_path):
    with pytest.raises(RecipeError, match=r"bagualu\.hardware\.capacity_bytes: the model is on cpu"):
        load(tmp_path, _checkpoint_dict(tmp_path, {"enabled": True}))


def test_a_given_model_disagreeing_with_the_checkpoint(tmp_path):
    section = {"enabled": True, "hardware": {"capacity_bytes": "1GB"}, "model": {"family": "qwen3_moe", "top_k": 4}}
    with pytest.raises(RecipeError, match=r"bagualu\.model\.top_k: 4 given, but the checkpoint at model\.init_method\.path .* has 2"):
        load(tmp_path, _checkpoint_dict(tmp_path, section))


def test_recipe_and_inline_together(tmp_path):
    with pytest.raises(RecipeError, match=r"bagualu\.recipe or inline sections, not both \(inline: bagualu\.budget\)"):
        load(tmp_path, nanotron_dict(**DEMO_SHAPE, bagualu={**DEMO, "budget": {}}))


def test_capacity_below_m0(tmp_path):
    tiny = {**INLINE, "hardware": {"preset": "cpu", "capacity_bytes": "64KB"}}
    with pytest.raises(RecipeError, match=r"bagualu\.hardware\.capacity_bytes: pipeline rank 0 of \d+: capacity .*M0"):
        load(tmp_path, nanotron_dict(bagualu=tiny))


def test_disabled_section_is_inert(tmp_path):
    config = load(tmp_path, nanotron_dict(pp=2, bagualu={**DEMO, "enabled": False}))  # pp disagrees, unchecked
    assert config.bagualu.enabled is False


def test_missing_nanotron_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nanotron" else real(name, *a))
    with pytest.raises(ImportError, match=r"bagualu-plugin\[nanotron\]"):
        compat.import_nanotron()
