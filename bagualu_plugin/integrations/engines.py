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
from typing import Any

_ZERO_STAGES = (0, 1, 2, 3)


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


def zero_budget(config: dict[str, Any]) -> dict[str, bool]:
    """The `budget` fields of a DeepSpeed config (the dict the Trainer or accelerate holds): ZeRO
    stage 1 shards the optimizer state over the data-parallel ranks, 2 the gradients too, 3 the
    weights as well (each module's gathered in its forward, as FSDP's); `offload_optimizer`
    keeps the optimizer state and the fp32 gradient partitions in host memory, `offload_param`
    the weights. Raises ValueError naming what it refuses."""
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
    return {"fsdp": stage == 3, "shard_optimizer": stage >= 1, "shard_gradients": stage >= 2, **offloaded}


def engine(state: Any) -> str | None:
    """The sharding engine accelerate runs (`state`: its `AcceleratorState`, None before one
    exists): "fsdp", "deepspeed", or None (DDP or one process)."""
    return next((name for name in ("fsdp", "deepspeed") if getattr(state, f"{name}_plugin", None) is not None), None)


def engine_budget(state: Any) -> dict[str, bool]:
    """The `budget` fields of the sharding engine accelerate runs (`engine`); {} for none."""
    name = engine(state)
    if name == "fsdp":
        return fsdp_budget(state.fsdp_plugin)
    if name == "deepspeed":
        return zero_budget(state.deepspeed_plugin.deepspeed_config)
    return {}


def trainer_budget(args: Any, state: Any) -> dict[str, bool]:
    """The `budget` fields of the sharding engine the Trainer really runs (`engine_budget`).
    Training arguments that ask for FSDP or DeepSpeed while the Trainer runs neither (accelerate
    enables them only on accelerator devices; on CPU it runs DistributedDataParallel) are named in
    a warning: the plugin then prices what runs."""
    if engine(state) is not None:
        return engine_budget(state)
    asked = [name for name in ("fsdp", "deepspeed") if getattr(args, name, None)]
    if asked:
        runs = getattr(getattr(state, "distributed_type", None), "value", "no distributed engine")
        warnings.warn(
            f"BagualuCallback: the training arguments ask for {' and '.join(asked)}, but the Trainer runs {runs} "
            "(accelerate shards only on accelerator devices): the plugin prices the memory of what runs, unsharded",
            RuntimeWarning, stacklevel=3,
        )
    return {}
