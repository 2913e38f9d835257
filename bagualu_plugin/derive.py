"""The recipe of a live model: what the model, the device and the launcher already know, derived,
and whatever the user gives winning over it (the paper's zero-configuration intervention).

- `model`: the checkpoint's dimensions (`adapters.costs.model_dims`: its config through the family
  traits table, dtype, attention kernel, PEFT adapters), under PEFT, DDP, FSDP and torch.compile
  wrappers. A given field that disagrees with the checkpoint is an error naming both values.
- `hardware`: on CUDA the device's name matched to a preset, its memory as the capacity; a device
  no preset knows gets the nearest preset's figures, with a warning naming them. A CPU has no
  device memory to derive: `hardware.capacity_bytes` (the simulated capacity) must be given.
- `parallel`: dp = the processes (the default process group, or the accelerator's), ep and its
  rank from an expert-parallel model's group.
- `pipeline`: pp 1, micro-batches = the gradient-accumulation steps (the Trainer's arguments or the
  accelerator's).
- `batch`: the training arguments' per-device batch and TRL's `max_length` where they say;
  otherwise the smallest, grown by the Provisioner to each larger micro-batch that arrives.
- everything else: the schema's defaults (`budget.non_activation_bytes: auto` is measured on the
  live model by the Provisioner).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from .adapters import Adapter
from .adapters.costs import model_dims
from .config import Recipe, RecipeError, read_recipe
from .hardware import PRESETS
from .runtime.ledger import model_device

PartialRecipe = Recipe | dict[str, Any] | str | os.PathLike[str] | None
GPU_PRESETS = ("h200", "h100", "a100")  # matched by name in the CUDA device's name, e.g. "NVIDIA H100 80GB HBM3"


def derive_recipe(
    model: nn.Module, recipe: PartialRecipe = None, *, accelerator=None, training_args=None, budget: dict[str, Any] | None = None
) -> Recipe:
    """`bgl.derive_recipe`: the full recipe of `model` as it trains here. `recipe` may be absent, a
    partial dict, a YAML path or a full `Recipe`; each section it gives is merged field by field
    over the derived one (a `Recipe` is taken whole, its model section checked). `budget`: the
    budget fields the sharding engine implies (`integrations.engines`)."""
    if accelerator is not None:
        device, processes = accelerator.device, accelerator.num_processes
    else:
        device = model_device(model.parameters())
        processes = torch.distributed.get_world_size() if torch.distributed.is_available() and torch.distributed.is_initialized() else 1
    micro_batches = next((int(n) for n in (getattr(s, "gradient_accumulation_steps", None) for s in (training_args, accelerator)) if n), 1)
    size = getattr(training_args, "per_device_train_batch_size", None) or 1
    length = getattr(training_args, "max_length", None)  # TRL's; HF Trainer's arguments have no sequence length
    batch = {"seq_len": int(length), "micro_batch_size": int(size)} if length else None
    return recipe_of(model, recipe, device=device, processes=processes, micro_batches=micro_batches, batch=batch, budget=budget)


def recipe_of(
    model: nn.Module, recipe: PartialRecipe, *, device: torch.device, processes: int, micro_batches: int, batch: dict | None,
    budget: dict[str, Any] | None = None,
) -> Recipe:
    """`derive_recipe` from facts already read: the compute `device`, the data-parallel
    `processes`, the gradient-accumulation `micro_batches`, the micro-batch shape (None: the
    smallest, which the Provisioner grows to each larger micro-batch that arrives) and the
    sharding engine's `budget` fields."""
    source, given = _given(recipe)
    adapter = Adapter(model)
    derived_model = model_dims(adapter.model)
    what = f"the {adapter.family.model_type} checkpoint ({type(adapter.model).__name__})"
    problems = disagreements(given.get("model"), derived_model.model_dump(), what)
    if problems:
        raise RecipeError(source, problems)
    if isinstance(recipe, Recipe):
        return recipe
    group = adapter.expert_group
    parallel = {"dp": processes, **({"ep": group.size, "ep_rank": group.rank} if group is not None else {})}
    sections = {
        "hardware": hardware_of(given.get("hardware"), device, source),
        "model": derived_model.model_dump(),
        "parallel": _merge(parallel, given.get("parallel")),
        "pipeline": _merge({"pp": 1, "rank": 0, "micro_batches": micro_batches}, given.get("pipeline")),
        "batch": _merge(batch or {"seq_len": 1, "micro_batch_size": 1}, given.get("batch")),
        **({"budget": _merge(budget, given.get("budget"))} if budget else {}),
    }
    rest = {name: value for name, value in given.items() if name not in sections}
    return Recipe.from_dict({**sections, **rest}, source)


def _given(recipe: PartialRecipe) -> tuple[str, dict[str, Any]]:
    if recipe is None:
        return "<derived>", {}
    if isinstance(recipe, Recipe):  # its model section as written (a default is no claim about the checkpoint)
        return "<Recipe>", {"model": recipe.model.model_dump(exclude_unset=True)}
    if isinstance(recipe, dict):
        return "<dict>", dict(recipe)
    if isinstance(recipe, (str, os.PathLike)):
        return read_recipe(recipe)
    raise TypeError(f"recipe must be None, a dict of recipe sections, a YAML path or a Recipe, got {type(recipe).__name__}")


def _merge(derived: dict[str, Any], given: Any) -> Any:
    """A given section's fields over the derived ones; a given non-mapping is the schema's to judge."""
    return {**derived, **given} if isinstance(given, dict) else derived if given is None else given


def disagreements(given: Any, derived: dict[str, Any], what: str) -> list[tuple[str, str]]:
    """The fields of a given `model:` section that are not what the checkpoint (`what`) has."""
    if given is None:
        return []
    if not isinstance(given, dict):
        return [("model", f"expected a mapping of model dimensions, got {given!r}")]
    unknown = [name for name in given if name not in derived]
    if unknown:
        return [(f"model.{name}", f"unknown key; expected one of: {', '.join(derived)}") for name in unknown]
    return [
        (f"model.{name}", f"{value!r} given, but {what} has {derived[name]!r}")
        for name, value in given.items()
        if _normal(value) != _normal(derived[name])
    ]


def checkpoint_model(path: str | os.PathLike[str]) -> nn.Module:
    """The model a saved HF checkpoint builds, on the meta device (its config.json only, no
    weights): what its dimensions are read from where no live model is at hand."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None))


def _normal(value: Any) -> Any:
    """Lists and tuples compare alike (YAML has no tuples), as do nested sections."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


def hardware_of(given: Any, device: torch.device, source: str) -> Any:
    """The hardware section: `device`'s preset and memory under what the recipe gives."""
    if isinstance(given, str) or (isinstance(given, dict) and ("preset" in given or "name" in given)):
        return given  # a preset, or a whole spec: the user's
    if device.type != "cuda":
        if isinstance(given, dict) and "capacity_bytes" in given:
            return {"preset": "cpu", **given}
        raise RecipeError(source, [(
            "hardware.capacity_bytes",
            f"the model is on {device.type}, which has no device memory to derive: give the simulated capacity, e.g. "
            "{'hardware': {'capacity_bytes': '8GiB'}} (the Ledger enforces it)",
        )])
    preset, unknown = preset_for(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    if unknown:
        warnings.warn(unknown, RuntimeWarning, stacklevel=4)
    return _merge({"preset": preset, "capacity_bytes": torch.cuda.get_device_properties(device).total_memory}, given)


def preset_for(name: str, capacity: int) -> tuple[str, str | None]:
    """The hardware preset of a CUDA device called `name` with `capacity` bytes, and for a device
    no preset knows (then the one nearest in memory) the warning that names the figures assumed."""
    preset = next((p for p in GPU_PRESETS if p in name.lower()), None)
    if preset is not None:
        return preset, None
    preset = min(GPU_PRESETS, key=lambda p: abs(PRESETS[p].capacity_bytes - capacity))
    spec = PRESETS[preset]
    return preset, (
        f"no hardware preset knows the CUDA device {name!r}: using {preset}'s figures (peak {spec.peak_flops:.3g} FLOP/s, "
        f"HBM {spec.hbm_bandwidth:.3g} B/s, host link {spec.host_link_bandwidth:.3g} B/s) with its own memory, "
        f"{capacity} bytes; give hardware: {{preset: ..., peak_flops: ..., ...}} to correct them"
    )
