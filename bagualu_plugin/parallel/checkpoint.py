"""Expert-parallel checkpoints: load an HF checkpoint so that each rank reads only its own experts,
and save an expert-parallel model back as one HF checkpoint.

`load_expert_parallel` builds the model on the meta device, shards it with `expert_parallel`, then
materialises it from the safetensors files; `load_pretrained` also leaves what a rank does not hold
(another pipeline stage's layers) on the meta device, unread. A checkpoint written by transformers 5 `save_pretrained`
holds the experts in the original per-expert layout (`experts.3.gate_proj.weight`), which
transformers fuses into the 3-D parameters on load (`conversion_mapping`, `WeightConverter`); other
checkpoints (gpt-oss) hold the fused tensors. Both are read through transformers' own conversion
mapping, so the keys mean what they mean to `from_pretrained`, and each rank reads only its rows: the
per-expert tensors of its experts, or a `get_slice` of the fused ones. What the checkpoint cannot
hold is made as `from_pretrained` makes it: non-persistent buffers (RoPE's `inv_freq`) by the
model's own `initialize_weights`, tied parameters by `tie_weights`.

`save_expert_parallel` gathers every sharded expert parameter to rank 0 of the expert-parallel group,
which writes the full state with `save_pretrained` (reverting the same conversion), so
`from_pretrained` loads the result as the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from copy import deepcopy
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..adapters.adapter import unwrap
from ..adapters.experts import IMPLEMENTATION
from .expert import ExpertGroup, expert_group, expert_parallel

try:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
except ImportError as error:  # the weight-conversion API of transformers 5 (also used by PEFT)
    raise ImportError(
        "bagualu_plugin.parallel.checkpoint needs transformers.conversion_mapping.get_model_conversion_mapping and "
        "transformers.core_model_loading (transformers>=5.17,<5.27); the installed transformers does not provide them"
    ) from error

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def expert_shards(model: nn.Module) -> dict[str, ExpertGroup]:
    """Name -> group of every sharded expert parameter: the direct parameters of an expert-parallel
    experts module whose leading dimension is its local expert count (`expert_parallel`'s rule)."""
    shards = {}
    for prefix, module in model.named_modules():
        group = expert_group(module)
        if group is None:
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() and param.size(0) == len(group.local):
                shards[f"{prefix}.{name}"] = group
    return shards


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (one file, or the shards of an index)."""
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        with safe_open(path / SINGLE_FILE, framework="pt") as f:
            return dict.fromkeys(f.keys(), path / SINGLE_FILE)
    raise FileNotFoundError(f"path {str(path)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}: expected a safetensors checkpoint")


def load_expert_parallel(path: str | Path, group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Load the HF checkpoint directory `path` as an expert-parallel model over `group` (default: the
    world): every rank reads and holds only its experts (`expert_parallel`'s contiguous block), the
    rest of the model whole. dtype: None keeps the checkpoint's (config.dtype). Returns the model in
    training mode, running the "bagualu" experts implementation. Call it on every rank of `group`."""
    return load_pretrained(path, expert_group=group or dist.group.WORLD, dtype=dtype)


def load_pretrained(
    path: str | Path,
    *,
    expert_group: dist.ProcessGroup | None = None,
    keep: Callable[[nn.Module], set[str]] | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Load the HF checkpoint directory `path` reading only what this rank holds, running the
    "bagualu" experts implementation, in training mode. `expert_group`: shard the experts over it
    (`expert_parallel`), else keep them whole; `keep(model)`: the state-dict names of the meta model
    to materialise, e.g. a pipeline stage's, the others staying on the meta device (a kept tied
    parameter is read from its partner's key). dtype: None keeps the checkpoint's."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"path {str(path)!r} has no config.json: expected a checkpoint directory written by save_pretrained")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or config.dtype, experts_implementation=IMPLEMENTATION)
    if expert_group is not None:
        expert_parallel(model, expert_group)
    meta = model.state_dict()
    tied = model.all_tied_weights_keys  # target -> source: one of the two in the checkpoint is enough
    partner = {**{source: target for target, source in tied.items()}, **tied}
    wanted = set(meta) if keep is None else keep(model)
    wanted |= {partner[key] for key in wanted if key in partner}
    state = _read_state(model, path, wanted)
    missing = {key for key in wanted - set(state) if partner.get(key) not in state}
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks parameters of the model: {sorted(missing)}")
    for key, tensor in state.items():
        if tensor.shape != meta[key].shape:
            raise ValueError(f"checkpoint {str(path)!r}: {key} has shape {tuple(tensor.shape)}, the model expects {tuple(meta[key].shape)}")
    model.load_state_dict({key: tensor.to(meta[key].dtype) for key, tensor in state.items()}, strict=False, assign=True)
    model.tie_weights(missing_keys=wanted - set(state), recompute_mapping=False)
    for tensor in model.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True  # transformers' mark of a loaded tensor: initialize_weights leaves it alone
    for name, buffer in model.named_non_persistent_buffers():
        module, _, attr = name.rpartition(".")
        model.get_submodule(module).register_buffer(attr, torch.empty_like(buffer, device="cpu"), persistent=False)
    model.initialize_weights()  # computes the non-persistent buffers (RoPE inv_freq) as from_pretrained does
    on_meta = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta and name in wanted]
    on_meta += [name for name, t in model.named_non_persistent_buffers() if t.is_meta]
    if on_meta:
        raise ValueError(f"load_pretrained left tensors on the meta device: {on_meta}")
    return model.train()


def _read_state(model: nn.Module, path: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The `wanted` part of the model's state from the checkpoint, keys renamed and converted as by
    `from_pretrained`, each sharded expert parameter read only for this rank's experts. Unknown keys
    are an error. Like
    `from_pretrained`, it records the conversions used on the model, so that `save_pretrained`
    writes the layout the checkpoint had."""
    files = _checkpoint_files(path)
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    meta = model.state_dict()
    shards = expert_shards(model)
    # checkpoint key -> (model key, converter source pattern or None), in the order transformers loads
    targets, unexpected = {}, []
    for key in sorted(files, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if target not in meta and key in meta:
            target, pattern = key, None
        if target in meta:
            targets[key] = (target, pattern)
        else:
            unexpected.append(key)
    if unexpected:
        raise ValueError(f"checkpoint {str(path)!r} holds keys the model does not have: {unexpected}")
    converted: dict[str, WeightConverter] = {}
    state = {}
    with ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt")) for file in set(files.values())}
        keep = _local_expert_keys(targets, shards)
        for key, (target, pattern) in targets.items():
            group = shards.get(target)
            if target not in wanted:
                continue
            if pattern is None and group is None:
                state[target] = handles[files[key]].get_tensor(key)
            elif pattern is None:
                rows = handles[files[key]].get_slice(key)
                if rows.get_shape()[0] != group.num_experts:
                    raise ValueError(
                        f"checkpoint {str(path)!r}: {key} has {rows.get_shape()[0]} rows, expected one per expert "
                        f"(num_experts={group.num_experts})"
                    )
                state[target] = rows[group.local.start : group.local.stop]
            elif group is None or key in keep:
                converter = converted.setdefault(target, deepcopy(by_pattern[pattern]))
                converter.add_tensor(target, key, pattern, handles[files[key]].get_tensor(key))
        for target, converter in converted.items():
            for name, tensor in converter.convert(target, model=model, config=model.config).items():
                state[name] = tensor[0] if isinstance(tensor, list) else tensor
    model._weight_conversions = [t for t in mapping if t.was_used()]
    return state


def _local_expert_keys(targets: dict[str, tuple[str, str | None]], shards: dict[str, ExpertGroup]) -> set[str]:
    """The per-expert checkpoint keys of this rank's experts: a converter merges one tensor per expert
    into a sharded parameter in key order (`dot_natural_key`), so the i-th key of a source pattern
    is expert i."""
    per_pattern: dict[tuple[str, str], list[str]] = {}
    for key, (target, pattern) in targets.items():
        if pattern is not None and target in shards:
            per_pattern.setdefault((target, pattern), []).append(key)
    keep = set()
    for (target, pattern), keys in per_pattern.items():
        group = shards[target]
        if len(keys) != group.num_experts:
            raise ValueError(
                f"the checkpoint holds {len(keys)} tensors {pattern!r} of {target}, expected one per expert "
                f"(num_experts={group.num_experts})"
            )
        keep.update(keys[group.local.start : group.local.stop])
    return keep


def save_expert_parallel(model: nn.Module, path: str | Path) -> None:
    """Write the expert-parallel `model` as one HF checkpoint of the whole model in `path`: rank 0 of
    the expert-parallel group gathers every sharded expert parameter and calls `save_pretrained`;
    the other ranks write nothing. Call it on every rank of the group (with data-parallel replicas,
    on one replica's group: they hold the same weights)."""
    model = unwrap(model)
    shards = expert_shards(model)
    if not shards:
        raise ValueError(f"save_expert_parallel: {type(model).__name__} has no expert-parallel layer; call expert_parallel first")
    state = model.state_dict()
    for name, group in shards.items():
        local = state[name].detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(group.size)] if group.rank == 0 else None
        dist.gather(local, parts, group=group.group, group_dst=0)
        if group.rank == 0:
            state[name] = torch.cat(parts)
    group = next(iter(shards.values()))  # expert_parallel gives every layer the same group
    if group.rank == 0:
        model.save_pretrained(path, state_dict=state)
    dist.barrier(group=group.group)
