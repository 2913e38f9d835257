"""nanotron's `Config` with a `bagualu:` section, and the bagualu `Recipe` a config implies.

nanotron reads YAML into dataclasses with dacite `strict=True`, so an extra section needs a
`Config` subclass (the pattern of nanotron's DoReMi example); the launcher passes it as
`config_class=`. The section holds only what neither nanotron nor the checkpoint knows: the
recipe's budget, strategies, spikes and telemetry (and, to override them, the hardware and the
model's dimensions), either inline or as a recipe (a built-in name or a path). Pipeline size and rank, micro-batches, batch
shape and dp/tp/ep come from nanotron's own sections; a recipe that repeats one of them must agree.
nanotron lays expert parallelism beside data parallelism (world = ep x pp x dp x tp), while a
recipe's expert-parallel group lives inside its data-parallel one: the recipe's `parallel.dp` is
nanotron's dp x expert_parallel_size, the replicas of the dense weights.

`metrics_path` is the launcher's: one JSON line per iteration, written with the section enabled
or not, so that stock and plugin runs compare.

The model's dimensions come from the HF checkpoint the launcher trains (`model.init_method.path`),
not from nanotron's `model_config`: nanotron's model configs (Llama, Starcoder2, Qwen2 with optional
MoE, or a user's own) do not carry what the cost model needs (family, head_dim, shared experts,
dense layers). A `model` section is needed only without a checkpoint on disk; given, it must agree
with the checkpoint, and nanotron's `model_config` fields with both. The hardware is this process's
device (`bagualu_plugin.derive`); on CPU `hardware.capacity_bytes`, the simulated capacity, is
needed. So `bagualu: {enabled: true}` (with the capacity on CPU) is a complete section.

Every problem is an error while the config loads, before training starts: nanotron's `Config`
runs `__post_init__` on load and again when `save_as_yaml` reloads what it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import dacite
import torch
import yaml

from ...adapters.costs import model_dims
from ...config import Recipe, RecipeError, check_pipeline, load_recipe
from ...derive import checkpoint_model, disagreements, hardware_of
from ...stage import Stage
from ...units import fmt_bytes
from .compat import import_nanotron

_nanotron_config = import_nanotron()

_INLINE = ("hardware", "model", "budget", "strategies", "spikes", "telemetry")
# nanotron's fields that own recompute: main's `recompute_layer`, and `moe_layer_recompute` of
# nanotron's MoE example configs. PyPI 0.4 has neither (dacite then rejects them as unknown keys).
_RECOMPUTE_OWNERS = ("recompute_layer", "moe_layer_recompute")
# Recipe model field -> nanotron model_config fields, compared where the model config has one: the
# names of nanotron's Qwen2 MoE config, or of the HF config.json a dict model_config copies.
_MODEL_FIELDS = {
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers",),
    "num_attention_heads": ("num_attention_heads",),
    "num_key_value_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "num_experts": ("moe_config.num_experts", "num_experts", "n_routed_experts"),
    "top_k": ("moe_config.top_k", "num_experts_per_tok"),
    "moe_intermediate_size": ("moe_config.moe_intermediate_size", "moe_intermediate_size"),
    "first_k_dense": ("first_k_dense_replace",),
}
_SOURCE = "nanotron config"


@dataclass
class BagualuArgs:
    """The `bagualu:` section. Disabled, it is inert (the run is stock nanotron) but for
    `metrics_path` and `manual_gc`."""

    enabled: bool = False
    dual_batch: bool = False  # the recipe's pipeline.dual_batch: fused steady points (§V-B)
    overlap_all_to_all: bool | None = None  # the recipe's pipeline.overlap_all_to_all (default: on with dual_batch)
    metrics_path: str | None = None
    manual_gc: bool = True  # the launcher's collector frozen after set-up, every rank collecting at each iteration's end
    recipe: str | None = None
    hardware: str | dict | None = None
    model: dict | None = None
    budget: dict | None = None
    strategies: dict | None = None
    spikes: dict | None = None
    telemetry: dict | None = None


@dataclass
class Config(_nanotron_config.Config):
    """nanotron's `Config` plus `bagualu`; load with `get_config_from_file(path, config_class=Config)`."""

    bagualu: BagualuArgs | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bagualu is not None and self.bagualu.enabled:
            check(self)


def check(config: Config) -> None:
    """Raise `RecipeError` for the first of: recompute owned by nanotron too, no recipe, a recipe
    disagreeing with nanotron's sections, a pipeline stage whose capacity cannot hold M0."""
    owners = [f"parallelism.{name}" for name in _RECOMPUTE_OWNERS if getattr(config.parallelism, name, False)]
    if owners:
        msg = f"bagualu.enabled and {' and '.join(owners)} both own recompute: turn one of them off"
        raise RecipeError(_SOURCE, [("bagualu.enabled", msg)])
    for rank in range(config.parallelism.pp):
        stage = Stage.of(recipe_for(config, rank))
        try:
            stage.budgets()
        except ValueError as exc:
            recipe = config.bagualu.recipe  # the capacity is the named recipe's, or the inline section's
            source, path = (recipe, "hardware.capacity_bytes") if recipe else (_SOURCE, "bagualu.hardware.capacity_bytes")
            raise RecipeError(source, [(path, str(exc))]) from None


def recipe_for(config: Config, pp_rank: int, ep_rank: int = 0) -> Recipe:
    """The recipe of pipeline rank `pp_rank` (expert-parallel rank `ep_rank`): the `bagualu`
    section's sections with pipeline, batch and parallel taken from nanotron's sections."""
    args = config.bagualu
    if args is None:
        raise RecipeError(_SOURCE, [("bagualu", "required, but missing")])
    inline = {name: getattr(args, name) for name in _INLINE if getattr(args, name) is not None}
    if args.recipe is not None and inline:
        msg = f"give bagualu.recipe or inline sections, not both (inline: {', '.join(f'bagualu.{n}' for n in inline)})"
        raise RecipeError(_SOURCE, [("bagualu.recipe", msg)])
    if args.recipe is not None:
        written = load_recipe(args.recipe)
        source, prefix = args.recipe, ""
        data = written.model_dump(exclude_unset=True)
    else:
        source, prefix, data = _SOURCE, "bagualu.", dict(inline)
    data = {**data, **_checkpoint_sections(config, data, source, prefix)}
    par, tokens = config.parallelism, config.tokens
    if args.dual_batch:
        try:
            check_pipeline(par.pp)
        except ValueError as exc:
            raise RecipeError(_SOURCE, [("bagualu.dual_batch", str(exc))]) from None
    if args.overlap_all_to_all is not None and not (args.dual_batch or data.get("pipeline", {}).get("dual_batch")):
        msg = "applies to the fused points of bagualu.dual_batch, which is off: set dual_batch: true"
        raise RecipeError(_SOURCE, [("bagualu.overlap_all_to_all", msg)])
    if tokens is None:
        raise RecipeError(_SOURCE, [("tokens", "required with a bagualu section (sequence length, micro-batches), but missing")])
    ep = getattr(par, "expert_parallel_size", 1)
    ours = {
        "pipeline.pp": (par.pp, "parallelism.pp"),
        "pipeline.micro_batches": (tokens.batch_accumulation_per_replica, "tokens.batch_accumulation_per_replica"),
        "batch.seq_len": (tokens.sequence_length, "tokens.sequence_length"),
        "batch.micro_batch_size": (tokens.micro_batch_size, "tokens.micro_batch_size"),
        "parallel.dp": (par.dp * ep, "parallelism.dp x parallelism.expert_parallel_size"),
        "parallel.tp": (par.tp, "parallelism.tp"),
        "parallel.ep": (ep, "parallelism.expert_parallel_size"),
    }
    model_config = config.model.model_config
    for field, names in _MODEL_FIELDS.items():
        for theirs in names:
            value = _get(model_config, theirs)
            if value is not None:
                ours[f"model.{field}"] = (value, f"model.model_config.{theirs}")
                break
    problems = []
    for path, (value, theirs) in ours.items():
        section, field = path.split(".")
        given = data.get(section, {}).get(field)
        if given is not None and given != value:
            problems.append((prefix + path, f"bagualu recipe {path}={given} disagrees with nanotron {theirs}={value}"))
    if problems:
        raise RecipeError(source, problems)
    data = {
        **data,
        "pipeline": {
            **data.get("pipeline", {}), "pp": par.pp, "rank": pp_rank, "micro_batches": tokens.batch_accumulation_per_replica,
            **({"dual_batch": True} if args.dual_batch else {}),
            **({"overlap_all_to_all": args.overlap_all_to_all} if args.overlap_all_to_all is not None else {}),
        },
        "batch": {"seq_len": tokens.sequence_length, "micro_batch_size": tokens.micro_batch_size},
        "parallel": {**data.get("parallel", {}), "dp": par.dp * ep, "tp": par.tp, "ep": ep, "ep_rank": ep_rank},
    }
    try:
        return Recipe.from_dict(data, source)
    except RecipeError as exc:
        raise RecipeError(source, [(prefix + path if path else path, msg) for path, msg in exc.problems]) from None


def _checkpoint_sections(config: Config, data: dict, source: str, prefix: str) -> dict:
    """What the section leaves out and the run knows: the model's dimensions from the HF
    checkpoint at `model.init_method.path` (a given `model` must agree with it), the hardware from
    this process's device (`derive.hardware_of`: on CPU the simulated capacity must be given)."""
    sections = {}
    path = getattr(config.model.init_method, "path", None)
    if path is not None and (Path(path) / "config.json").is_file():
        derived = _dims(str(Path(path).resolve()))
        problems = disagreements(data.get("model"), derived, f"the checkpoint at model.init_method.path ({path})")
        if problems:
            raise RecipeError(source, [(prefix + p, m) for p, m in problems])
        sections["model"] = derived
    elif "model" not in data:
        where = f"no config.json at model.init_method.path ({path})" if path else "model.init_method is a random init"
        raise RecipeError(source, [(prefix + "model", f"required: {where}, so the dimensions cannot be read from a checkpoint")])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        sections["hardware"] = hardware_of(data.get("hardware"), device, source)
    except RecipeError as exc:
        raise RecipeError(source, [(prefix + p, m) for p, m in exc.problems]) from None
    return sections


@cache
def _dims(path: str) -> dict:
    """The checkpoint's dimensions (every rank's recipe, and every reload of the config, reads them)."""
    return model_dims(checkpoint_model(path)).model_dump()


def _get(obj: Any, dotted: str) -> Any:
    """A field of a nanotron model config, a dataclass or (for configs nanotron has no class for) a dict."""
    for name in dotted.split("."):
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def validate(path: str) -> str:
    """Load the nanotron YAML at `path` as training would (which runs `check` on every pipeline
    rank) and describe its tightest stage, the one with the most static bytes plus in-flight M0s.
    Every problem is a `RecipeError` naming the field, dacite's unknown keys and wrong types
    included, since `bagualu validate-recipe` reports those."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    try:
        config = _nanotron_config.get_config_from_file(path, config_class=Config)
    except dacite.UnexpectedDataError as exc:
        raise RecipeError(path, [(key, "unknown key") for key in sorted(_paths_of(raw, exc.keys))]) from None
    except dacite.DaciteFieldError as exc:
        raise RecipeError(path, [(exc.field_path or "", str(exc))]) from None
    except RecipeError as exc:
        raise RecipeError(path if exc.source == _SOURCE else exc.source, exc.problems) from None
    except ValueError as exc:  # nanotron's own checks in __post_init__, e.g. lr_warmup_style
        raise RecipeError(path, [("", f"nanotron: {exc}")]) from None
    if config.bagualu is None or not config.bagualu.enabled:
        raise RecipeError(path, [("bagualu.enabled", "the bagualu section is missing or disabled: nothing to validate")])
    par = config.parallelism
    ep = getattr(par, "expert_parallel_size", 1)
    stages = [Stage.of(recipe_for(config, rank)) for rank in range(par.pp)]
    tight = max(stages, key=lambda s: s.static_bytes + s.warmup * s.min_budget)
    r, static, m0, capacity = tight.recipe, fmt_bytes(tight.static_bytes), fmt_bytes(tight.min_budget), fmt_bytes(tight.capacity)
    return (
        f"nanotron config, {r.model.family}, {ep * par.pp * par.dp * par.tp} devices of {r.hardware.name} = "
        f"ep {ep} x pp {par.pp} x dp {par.dp} x tp {par.tp}; tightest stage pp rank {r.pipeline.rank}: "
        f"static {static} + {tight.warmup} in flight x M0 {m0} of capacity {capacity}"
    )


def _paths_of(data: Any, keys: set[str], prefix: str = "") -> list[str]:
    """The dotted paths of `keys` in the YAML data (dacite names an unknown key, not its section)."""
    if not isinstance(data, dict):
        return []
    found = [prefix + k for k in data if k in keys]
    return found + [p for k, v in data.items() for p in _paths_of(v, keys, f"{prefix}{k}.")]
