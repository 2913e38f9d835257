"""Recipe schema and loader: shipped recipes, Table II presets, hardware forms, and bad recipes."""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import pytest
import yaml

from bagualu_plugin.config import Recipe, RecipeError, builtin_recipes, load_recipe
from bagualu_plugin.costmodel.dims import param_count
from bagualu_plugin.hardware import PRESETS

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "bagualu"
SHIPPED = sorted(RECIPES.glob("*.yaml")) + sorted(RECIPES.glob("cluster/*.yaml"))

GOOD = {
    "hardware": "h100",
    "model": {
        "family": "glm4_moe",
        "hidden_size": 256,
        "num_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "vocab_size": 1000,
        "num_experts": 16,
        "top_k": 4,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "first_k_dense": 1,
        "dense_intermediate_size": 512,
    },
    "parallel": {"dp": 4, "tp": 2, "ep": 8},
    "pipeline": {"pp": 4, "rank": 1, "micro_batches": 16},
    "batch": {"seq_len": 4096, "micro_batch_size": 2},
    "strategies": {
        "allowed": ["recompute", "fp8"],
        "fp8": {"block_size": 64},
        "offload": {"min_bytes": "4 MiB"},
    },
    "budget": {"reserve_bytes": "2GiB", "min_budget": "1GiB"},
    "telemetry": {"path": "events.jsonl"},
    "spikes": {"enabled": True, "layers": [1, 7], "micro_batches": [0, 15]},
}


DELETE = object()
MLA = {"q_lora_rank": 0, "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


def patched(**changes: object) -> dict:
    """GOOD with dotted paths (written with `__` for `.`) set, or deleted when the value is DELETE."""
    data = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return data


@pytest.mark.parametrize("file", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_loads(file: Path) -> None:
    recipe = load_recipe(file)
    assert recipe.model.num_layers % recipe.pipeline.pp == 0
    assert load_recipe(file.stem) == recipe  # by built-in name


def test_builtin_recipes_are_the_shipped_files() -> None:
    assert {name: path.resolve() for name, path in builtin_recipes().items()} == {p.stem: p for p in SHIPPED}
    assert len(SHIPPED) == 13  # 4 families, the demo, 8 Table II presets
    assert load_recipe("glm-423b-a30b").gpus == 512


def test_good_recipe_values_and_defaults() -> None:
    r = Recipe.from_dict(GOOD)
    assert r.hardware == PRESETS["h100"]
    assert (r.gpus, r.batch.tokens) == (4 * 2 * 4, 8192)
    assert r.strategies.offload.min_bytes == 4 * 2**20
    b = r.budget
    assert (b.reserve_bytes, b.min_budget, b.non_activation_bytes) == (2 * 2**30, 2**30, "auto")
    minimal = Recipe.from_dict({k: GOOD[k] for k in ("hardware", "model", "pipeline", "batch")})
    assert minimal.parallel.model_dump() == {"dp": 1, "tp": 1, "ep": 1, "ep_rank": 0, "all_to_all": None}
    assert not minimal.parallel.dispatches
    assert minimal.strategies.allowed == ["recompute", "offload", "fp8"]
    assert (minimal.strategies.fp8.block_size, minimal.strategies.offload.min_bytes) == (128, 2**20)
    assert (minimal.spikes.enabled, minimal.spikes.layers, minimal.telemetry.path) == (False, "all", None)
    assert (minimal.spikes.spike_probability, minimal.spikes.spike_max_imbalance) == (0.029, 2.6)
    assert minimal.spikes.restart_iterations == 16


# Table II of the paper: name, hidden, MoE hidden, experts, top-k, head dim, GPUs, DP, TP, EP, PP, VP.
TABLE_II = [
    ("glm-188b-a20b", 7168, 4096, 64, 4, 112, 128, 16, 2, 32, 4, 2),
    ("glm-319b-a30b", 8192, 4096, 96, 6, 128, 256, 16, 2, 32, 8, 1),
    ("glm-423b-a30b", 8192, 4096, 128, 6, 128, 512, 32, 2, 64, 8, 2),
    ("glm-629b-a30b", 8192, 4096, 192, 6, 128, 1024, 64, 2, 64, 8, 2),
    ("glm-783b-a35b", 8192, 5120, 192, 6, 128, 2048, 128, 2, 64, 8, 1),
    ("glm-835b-a30b", 8192, 4096, 256, 6, 128, 4096, 256, 2, 128, 8, 2),
    ("glm-1041b-a35b-8192", 8192, 5120, 256, 6, 128, 8192, 512, 2, 128, 8, 2),
    ("glm-1041b-a35b-12288", 8192, 5120, 256, 6, 128, 12288, 768, 2, 128, 8, 2),
]


@pytest.mark.parametrize("row", TABLE_II, ids=lambda row: row[0])
def test_cluster_preset_matches_table_ii(row: tuple) -> None:
    name, hidden, moe_hidden, experts, top_k, head_dim, gpus, dp, tp, ep, pp, vp = row
    r = load_recipe(name)
    m = r.model
    assert (m.family, m.num_layers, m.hidden_size, m.head_dim) == ("glm4_moe", 32, hidden, head_dim)
    assert (m.moe_intermediate_size, m.num_experts, m.top_k) == (moe_hidden, experts, top_k)
    assert (r.parallel.dp, r.parallel.tp, r.parallel.ep, r.pipeline.pp) == (dp, tp, ep, pp)
    assert r.gpus == gpus
    assert r.hardware == PRESETS["bagualu2"]
    assert (r.pipeline.rank, r.pipeline.micro_batches, r.batch.seq_len) == (0, 4 * pp, 4096)
    assert f"VP = {vp} layer" in builtin_recipes()[name].read_text() and r.pipeline.vp == m.num_layers // (pp * vp)
    total, active = (int(x) * 1e9 for x in re.match(r"glm-(\d+)b-a(\d+)b", name).groups())
    assert param_count(m) == pytest.approx(total, rel=0.01)
    assert param_count(m, active=True) == pytest.approx(active, rel=0.01)


def test_hardware_as_preset_name_override_or_full_mapping() -> None:
    h100 = PRESETS["h100"]
    assert Recipe.from_dict(patched(hardware="h100")).hardware == h100
    override = Recipe.from_dict(patched(hardware={"preset": "h100", "capacity_bytes": "40GiB"})).hardware
    assert override == h100.model_copy(update={"capacity_bytes": 40 * 2**30})
    full = {
        "name": "mine",
        "peak_flops": "400 TFLOP/s",
        "capacity_bytes": "48GiB",
        "hbm_bandwidth": "2 TB/s",
        "host_link_bandwidth": "32 GB/s",
        "intra_node_bandwidth": "300 GB/s",
        "inter_node_bandwidth": "200 Gb/s",
        "devices_per_node": 4,
        "kernel_launch_s": "5us",
        "copy_launch_s": "10us",
    }
    hw = Recipe.from_dict(patched(hardware=full)).hardware
    assert (hw.name, hw.capacity_bytes, hw.inter_node_bandwidth) == ("mine", 48 * 2**30, 25e9)


@pytest.mark.parametrize("hardware", ["tpu", {"preset": "tpu", "capacity_bytes": "40GiB"}])
def test_unknown_hardware_preset_lists_known_names(hardware: object) -> None:
    with pytest.raises(RecipeError) as err:
        Recipe.from_dict(patched(hardware=hardware))
    assert err.value.source == "<dict>"
    [(path, msg)] = err.value.problems
    assert path == "hardware" and "'tpu'" in msg and all(name in msg for name in PRESETS)


# (id, changes to GOOD, the one field path every problem must name, a fragment of the message)
BAD = [
    ("unknown-section", {"checkpointing": {}}, "checkpointing", "unknown key; expected one of: hardware,"),
    ("unknown-nested-key", {"pipeline__stages": 2}, "pipeline.stages", "expected one of: pp, rank"),
    ("unknown-mla-key", {"model__mla": {**MLA, "rank": 1}}, "model.mla.rank", "expected one of: q_lora_rank"),
    ("string-for-int", {"batch__seq_len": "long"}, "batch.seq_len", "valid integer, got 'long'"),
    ("numeric-string-strict", {"parallel__tp": "8"}, "parallel.tp", "got '8'"),
    ("bool-for-int", {"model__num_layers": True}, "model.num_layers", "got True"),
    ("section-not-mapping", {"parallel": 8}, "parallel", "got 8"),
    ("negative", {"spikes__seed": -1}, "spikes.seed", "greater than or equal to 0"),
    ("zero-micro-batches", {"pipeline__micro_batches": 0}, "pipeline.micro_batches", "or equal to 1, got 0"),
    ("rank-not-below-pp", {"pipeline__rank": 4}, "pipeline.rank", "rank (4) must be < pp (4)"),
    ("vp-zero", {"pipeline__vp": 0}, "pipeline.vp", "or equal to 1, got 0"),
    ("vp-without-pipeline", {"pipeline__pp": 1, "pipeline__rank": 0, "pipeline__vp": 2}, "pipeline.vp", "needs pp >= 2, got 1"),
    (
        "vp-micro-batches-not-groups-of-pp", {"pipeline__vp": 2, "pipeline__micro_batches": 6, "spikes__micro_batches": [0]},
        "pipeline.vp", "micro_batches (6) must be a multiple of pp (4)",
    ),
    ("layers-not-divisible-by-pp-vp", {"pipeline__vp": 3}, "pipeline.vp", "pp*vp (12) must divide model.num_layers (8)"),
    ("top-k-over-experts", {"model__top_k": 17}, "model.top_k", "top_k (17) exceeds num_experts (16)"),
    ("autocast-other-half", {"model__dtype": "bf16", "model__autocast": "fp16"}, "model.autocast",
     "autocast to fp16 over bf16 weights is not modelled"),
    ("ep-not-dividing-experts", {"model__num_experts": 12}, "parallel.ep", "num_experts (12)"),
    ("ep-not-dividing-dp-tp", {"parallel__dp": 2}, "parallel.ep", "dp*tp (4)"),
    ("layers-not-divisible-by-pp", {"model__num_layers": 10}, "pipeline.pp", "num_layers (10)"),
    ("heads-not-divisible-by-tp", {"parallel__dp": 8, "parallel__tp": 3}, "parallel.tp", "heads (16)"),
    ("fp8-block-not-power-of-2", {"strategies__fp8__block_size": 96}, "strategies.fp8.block_size", "(96)"),
    ("fp8-block-too-small", {"strategies__fp8__block_size": 8}, "strategies.fp8.block_size", "16"),
    ("unknown-strategy", {"strategies__allowed": ["recompute", "swap"]}, "strategies.allowed.1", "'swap'"),
    ("duplicate-strategy", {"strategies__allowed": ["fp8", "fp8"]}, "strategies.allowed.1", "listed twice"),
    ("keep-listed", {"strategies__allowed": ["recompute", "keep"]}, "strategies.allowed.1", "always allowed"),
    ("reserve-over-capacity", {"budget__reserve_bytes": "100GiB"}, "budget.reserve_bytes", "capacity_bytes"),
    ("min-budget-over-capacity", {"budget__min_budget": "80GiB"}, "budget.min_budget", "79.65 GiB"),
    ("min-budget-bad-unit", {"budget__min_budget": "1 GiBs"}, "budget.min_budget", "cannot read '1 GiBs'"),
    ("spike-probability-over-1", {"spikes__spike_probability": 1.5}, "spikes.spike_probability", "got 1.5"),
    ("spike-below-normal", {"spikes__spike_max_imbalance": 1.1}, "spikes.spike_max_imbalance", "(1.2)"),
    ("restart-negative", {"spikes__restart_iterations": -1}, "spikes.restart_iterations", "greater than or equal to 0"),
    ("spike-layer-dense", {"spikes__layers": [1, 0]}, "spikes.layers.1", "layer 0 is not an MoE layer"),
    ("spike-layer-negative", {"spikes__layers": [-1]}, "spikes.layers.0", "greater than or equal to 0"),
    ("spike-micro-batch-range", {"spikes__micro_batches": [0, 16]}, "spikes.micro_batches.1", "16 must be <"),
    ("unknown-hardware-preset", {"hardware": "tpu"}, "hardware", "known: a100, bagualu2"),
    (
        "bad-unit-string",
        {"hardware": {"preset": "h100", "capacity_bytes": "64 GiBs"}},
        "hardware.capacity_bytes",
        "cannot read '64 GiBs' as a size",
    ),
    ("schedule-afab", {"pipeline__schedule": "afab"}, "pipeline.schedule", "'1f1b', got 'afab'"),
    ("ep-rank-outside-group", {"parallel__ep_rank": 8}, "parallel.ep_rank", "ep_rank (8) must be < ep (8)"),
    ("kv-heads-not-dividing", {"model__num_key_value_heads": 3}, "model.num_key_value_heads", "multiple of"),
    (
        "dense-layers-without-width", {"model__first_k_dense": 1, "model__dense_intermediate_size": 0},
        "model.dense_intermediate_size", "> 0",
    ),
    ("deepseek-without-mla", {"model__family": "deepseek_v3"}, "model.mla", "mla dimensions are required"),
    ("missing-model", {"model": DELETE}, "model", "required, but missing"),
]


@pytest.mark.parametrize(("changes", "path", "fragment"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_recipe_names_file_and_field(tmp_path: Path, changes: dict, path: str, fragment: str) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(yaml.safe_dump(patched(**changes)))
    with pytest.raises(RecipeError) as err:
        load_recipe(file)
    assert err.value.source == str(file)
    assert {p for p, _ in err.value.problems} == {path}
    lines = str(err.value).splitlines()
    assert len(lines) == len(err.value.problems)
    assert all(line.startswith(f"recipe {file}: {path}: ") for line in lines)
    assert fragment in str(err.value)


def test_dict_source_and_every_cross_field_problem_reported() -> None:
    with pytest.raises(RecipeError) as err:
        Recipe.from_dict(patched(parallel__tp=3, model__num_layers=10))
    assert err.value.source == "<dict>"
    assert [p for p, _ in err.value.problems] == ["parallel.ep", "parallel.tp", "pipeline.pp"]
    assert str(err.value).startswith("recipe <dict>: parallel.ep: ep (8) must divide dp*tp (12)")


def test_recipe_error_survives_pickling() -> None:
    error = RecipeError("x.yaml", [("pipeline.rank", "rank (8) must be < pp (8)")])
    copied = pickle.loads(pickle.dumps(error))
    assert (copied.source, copied.problems, str(copied)) == (error.source, error.problems, str(error))
    assert str(error) == "recipe x.yaml: pipeline.rank: rank (8) must be < pp (8)"


GOOD_YAML = yaml.safe_dump(GOOD, sort_keys=False)
TWO_RANKS = GOOD_YAML.replace("  rank: 1\n", "  rank: 1\n  rank: 2\n")

# (id, file text, path, fragment): problems of the file itself rather than of one field's value.
BAD_FILES = [
    ("duplicate-key", TWO_RANKS, "pipeline.rank", "duplicate key"),
    ("duplicate-top-key", GOOD_YAML + "hardware: h200\n", "hardware", "first at line 1"),
    ("syntax-error", "hardware: h100\nmodel: {family: x\npipeline: {pp: 1}\n", "", "invalid YAML: line 3"),
    ("top-level-list", "- hardware: h100\n", "", "got a list"),
    ("empty-file", "", "", "the file is empty"),
    ("only-comments", "# nothing here\n", "", "the file is empty"),
    ("python-tag", "hardware: !!python/object:os.system {}\n", "", "invalid YAML: line 1"),
]


@pytest.mark.parametrize(
    ("text", "path", "fragment"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_bad_file(tmp_path: Path, text: str, path: str, fragment: str) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(file)
    assert err.value.problems[0][0] == path
    assert str(err.value).startswith(f"recipe {file}: {path + ': ' if path else ''}")
    assert fragment in str(err.value)


def test_duplicate_key_names_its_line(tmp_path: Path) -> None:
    file = tmp_path / "dup.yaml"
    file.write_text("hardware: h100\nspikes:\n  seed: 1\n  layers: [1]\n  seed: 2\n")
    with pytest.raises(RecipeError, match=r": spikes\.seed: duplicate key at line 5 \(first at line 3\)"):
        load_recipe(file)


def test_missing_file_lists_builtin_recipes(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe(tmp_path / "nope.yaml")
    assert err.value.source == str(tmp_path / "nope.yaml")
    assert all(s in str(err.value) for s in ("No such file", "glm-423b-a30b", "qwen3_moe"))
