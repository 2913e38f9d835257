"""What a sharding engine keeps on each rank, read from its own configuration: FSDP2 (accelerate's
`FullyShardedDataParallelPlugin`, which the Trainer's `fsdp` arguments and `accelerate launch`
make) and DeepSpeed ZeRO (its JSON config, which the Trainer's `deepspeed` argument and
accelerate's DeepSpeed plugin carry). Each becomes the recipe's `budget` fields that price the
non-activation bytes (weights, gradients, optimizer state per rank); what the plugin cannot price
or would fight (another owner of recompute) is refused by name.

The activations are the Ledger's either way: it never counts a parameter, sharded or gathered
(FSDP2's unsharded parameters while its pre-forward hook has them gathered, ZeRO-3's gathered
`param.data`), so a micro-batch keeps what it keeps unsharded.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

from ..adapters import Adapter
from ..costmodel.dims import DTYPE_BYTES

_ZERO_STAGES = (0, 1, 2, 3)
_ENGINES = ("fsdp", "deepspeed")  # accelerate's names: its `<name>_plugin`, `accelerate launch`'s ACCELERATE_USE_<NAME>


def fsdp_budget(plugin: Any) -> dict[str, bool]:
    """The `budget` fields of accelerate's FSDP plugin: FSDP2 full shard (each layer's weights
    gathered in its forward and freed after it), optionally with the weights, gradients and
    optimizer state in host memory (`cpu_offload`). Raises ValueError naming what it refuses."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    refused = []
    if plugin.fsdp_version != 2:
        refused.append(f"fsdp_version={plugin.fsdp_version}: the plugin prices FSDP2's sharding; set fsdp_config's fsdp_version to 2")
    if getattr(plugin, "activation_checkpointing", False):
        refused.append("activation_checkpointing=True: it recomputes whole layers, the plugin plans recompute per operator")
    if plugin.reshard_after_forward is not True:
        refused.append(
            f"reshard_after_forward={plugin.reshard_after_forward!r}: every layer's weights would stay gathered from its "
            "forward to its backward, which the plugin does not price; use True (full shard)"
        )
    if refused:
        raise ValueError("FSDP: " + "; ".join(refused))
    offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    return {"fsdp": True, "shard_optimizer": True, "offload_params": offload, "offload_optimizer": offload}


def zero_budget(config: dict[str, Any], hidden_size: int | None = None, param_bytes: int | None = None) -> dict[str, bool | int]:
    """The `budget` fields of a DeepSpeed config (the dict the Trainer or accelerate holds): ZeRO
    stage 1 shards the optimizer state over the data-parallel ranks, 2 the gradients too, 3 the
    weights as well (each module's gathered in its forward, as FSDP's); `offload_optimizer`
    keeps the optimizer state and the fp32 gradient partitions in host memory, `offload_param`
    the weights; the engine's gradient reduce buckets (`zero_buffer_bytes`); and, given the
    model's `param_bytes`, the bytes per parameter (`zero_widths`). `hidden_size`: the model's,
    which an "auto" bucket size is made of. Raises ValueError naming what it refuses."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    refused = []
    if stage not in _ZERO_STAGES:
        refused.append(f"zero_optimization.stage={stage!r}: expected one of {_ZERO_STAGES}")
    checkpointing = config.get("activation_checkpointing") or {}
    if checkpointing.get("partition_activations") or checkpointing.get("cpu_checkpointing"):
        refused.append(
            "activation_checkpointing: DeepSpeed's partitions or offloads checkpointed activations, "
            "which would own what the plugin plans per operator; remove the section"
        )
    offloaded = {
        name: (zero.get(key) or {}).get("device", "none") not in ("none", None)
        for name, key in (("offload_optimizer", "offload_optimizer"), ("offload_params", "offload_param"))
    }
    if offloaded["offload_params"] and stage != 3:
        refused.append(f"zero_optimization.offload_param needs stage 3, got stage {stage}")
    if refused:
        raise ValueError("DeepSpeed: " + "; ".join(refused))
    buffers = zero_buffer_bytes(config, hidden_size)
    widths = {} if param_bytes is None else zero_widths(config, param_bytes)
    return {"fsdp": stage == 3, "shard_optimizer": stage >= 1, "shard_gradients": stage >= 2, **offloaded, "engine_buffer_bytes": buffers,
            **widths}


def zero_widths(config: dict[str, Any], param_bytes: int) -> dict[str, float]:
    """The bytes per parameter DeepSpeed keeps for a model whose parameters are `param_bytes`
    wide. Under `bf16` or `fp16` it casts the weights to 2 bytes and keeps FP32 gradient
    partitions and an FP32 master beside Adam's two moments: the budget's defaults (2, 4, 12),
    nothing returned. Without them the weights stay the model's; in FP32 the optimizer of stages
    0-2 updates the flat FP32 weights themselves (its master is them: 8 bytes, the two moments)
    and stage 3 keeps an FP32 partition beside them (12). Where the half precision is still
    "auto" the weights are priced at the wider of the two."""
    enabled = [(config.get(name) or {}).get("enabled") for name in ("bf16", "fp16")]
    if True in enabled:
        return {}
    if "auto" in enabled:
        return {"weight_bytes_per_param": max(2, param_bytes)}
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    master = param_bytes == 4 and stage < 3
    return {"weight_bytes_per_param": param_bytes, "optimizer_bytes_per_param": 8 if master else 12}


def parameter_bytes(model: Any) -> int:
    """The width most of `model`'s parameters have, by count (ZeRO-3's partitioned parameters
    counted whole, `ds_numel`): what a sharding engine keeps its weights in, unless it casts them."""
    sizes: Counter[int] = Counter()
    for p in model.parameters():
        sizes[p.element_size()] += getattr(p, "ds_numel", p.numel())
    return sizes.most_common(1)[0][0]


_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size, in elements


def zero_buffer_bytes(config: dict[str, Any], hidden_size: int | None = None) -> int:
    """The device bytes of ZeRO's gradient reduce buckets (`contiguous_gradients`, on by default),
    `reduce_bucket_size` elements each: stage 3 allocates one when the engine is made and keeps it,
    stages 1 and 2 one as each backward begins, with the activations at their peak (two with
    `overlap_comm`, off by default below stage 3). Their dtype is the communication's
    (`communication_data_type`) at stage 3, else the weights' (2 bytes under `bf16` or `fp16`;
    4 where that is "auto", the larger). An "auto" size is `hidden_size` squared, as the Trainer
    and accelerate fill it. Raises ValueError where it is "auto" and `hidden_size` is not given."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage == 0 or zero.get("contiguous_gradients", True) is False:
        return 0
    size = zero.get("reduce_bucket_size", _BUCKET)
    if size == "auto":
        if hidden_size is None:
            raise ValueError("DeepSpeed: zero_optimization.reduce_bucket_size='auto': pass the model's hidden_size to price it")
        size = hidden_size * hidden_size
    if not isinstance(size, (int, float)) or size <= 0:
        raise ValueError(f"DeepSpeed: zero_optimization.reduce_bucket_size={size!r}: expected a positive number of elements or 'auto'")
    half = any((config.get(name) or {}).get("enabled") is True for name in ("bf16", "fp16"))
    dtype = config.get("communication_data_type") if stage == 3 else None
    width = DTYPE_BYTES.get(dtype, 2 if half else 4)
    count = 1 if stage == 3 or not zero.get("overlap_comm", False) else 2
    return int(size) * width * count


def engine(state: Any) -> str | None:
    """The sharding engine accelerate runs (`state`: its `AcceleratorState`, None before one
    exists): "fsdp", "deepspeed", or None (DDP or one process)."""
    return next((name for name in _ENGINES if getattr(state, f"{name}_plugin", None) is not None), None)


def engine_budget(state: Any, model: Any = None, asked: list[str] | None = None) -> dict[str, bool | int]:
    """The `budget` fields of the sharding engine accelerate runs (`engine`) for `model` (its
    hidden size and parameter width; None: an "auto" bucket size is refused, the widths are the
    budget's defaults); {} for none. An engine asked for that does not run is named in a warning
    (`asked`: what asked for one besides `accelerate launch`'s config, whose flags are read here),
    and what runs is priced: accelerate enables FSDP only on accelerator devices, so on CPU it
    runs DistributedDataParallel (or, for an Accelerator not on `cpu=True`, each process alone)."""
    name = engine(state)
    if name == "fsdp":
        return fsdp_budget(state.fsdp_plugin)
    if name == "deepspeed":
        hidden, width = (None, None) if model is None else (Adapter(model).config.hidden_size, parameter_bytes(model))
        return zero_budget(state.deepspeed_plugin.deepspeed_config, hidden, width)
    from accelerate.utils import parse_flag_from_env

    flags = (f"ACCELERATE_USE_{name.upper()}" for name in _ENGINES)  # what `accelerate launch` sets from its config
    asked = [*(asked or []), *(f"accelerate launch's {flag}" for flag in flags if parse_flag_from_env(flag))]
    if asked:
        runs = getattr(getattr(state, "distributed_type", None), "value", "no distributed engine")
        verb = "ask" if len(asked) > 1 else "asks"
        warnings.warn(
            f"bagualu: {' and '.join(asked)} {verb} for a sharding engine, but accelerate runs {runs} (it shards only on "
            "accelerator devices): the plugin prices the memory of what runs, unsharded",
            RuntimeWarning, stacklevel=3,
        )
    return {}


def trainer_budget(args: Any, state: Any, model: Any = None) -> dict[str, bool | int]:
    """`engine_budget` for the Trainer, whose own `fsdp` and `deepspeed` arguments ask for an engine too."""
    return engine_budget(state, model, [f"the training arguments' {name}" for name in _ENGINES if getattr(args, name, None)])
