"""nanotron's Config with a `bagualu:` section: YAML loading with nanotron's own loader, the
save/reload round trip, the recipe it implies, and each bad config as an error naming the fields."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytest.importorskip("nanotron")

from nanotron_configs import config_dict, load  # noqa: E402

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


def test_enabled_without_recipe(tmp_path):
    with pytest.raises(RecipeError, match=r"bagualu\.recipe or an inline bagualu\.hardware"):
        load(tmp_path, nanotron_dict(bagualu={"enabled": True}))


def test_inline_without_model(tmp_path):
    with pytest.raises(RecipeError, match=r"bagualu\.model: required, but missing"):
        load(tmp_path, nanotron_dict(bagualu={"enabled": True, "hardware": "cpu"}))


def test_recipe_and_inline_together(tmp_path):
    with pytest.raises(RecipeError, match=r"bagualu\.recipe or inline sections, not both \(inline: bagualu\.budget\)"):
        load(tmp_path, nanotron_dict(**DEMO_SHAPE, bagualu={**DEMO, "budget": {}}))


def test_capacity_below_m0(tmp_path):
    tiny = {**INLINE, "hardware": {"preset": "cpu", "capacity_bytes": "64KB"}}
    with pytest.raises(RecipeError, match=r"bagualu\.hardware\.capacity_bytes: pipeline rank 0: .*M0"):
        load(tmp_path, nanotron_dict(bagualu=tiny))


def test_disabled_section_is_inert(tmp_path):
    config = load(tmp_path, nanotron_dict(pp=2, bagualu={**DEMO, "enabled": False}))  # pp disagrees, unchecked
    assert config.bagualu.enabled is False


def test_missing_nanotron_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nanotron" else real(name, *a))
    with pytest.raises(ImportError, match=r"bagualu-plugin\[nanotron\]"):
        compat.import_nanotron()
