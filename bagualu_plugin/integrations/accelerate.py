"""Accelerate: adaptive activation memory in a training loop without pipeline parallelism.

The gradient-accumulation micro-batches are the provisioning unit: each runs its forward and then
its backward, so one micro-batch is in flight and Algorithm 1 gives it all the free memory (the
recipe's `pipeline.pp` is 1, `pipeline.micro_batches` the accumulation steps); routing spikes are
caught at the gate as in a pipeline. Accelerate takes no third-party kwargs handlers and no
unknown config keys, so the plugin goes on the model before `accelerator.prepare`; the recipe is
derived from the model, the device and the accelerator (its processes, its gradient-accumulation
steps), whatever `recipe` gives winning, and the micro-batches' boundaries are found on the model:

    prov = apply(model, {"hardware": {"capacity_bytes": "40GiB"}}, accelerator)  # before prepare
    model, optimizer = accelerator.prepare(model, optimizer)
    for ids in micro_batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step(); optimizer.zero_grad()

(`prepare_model` is the same without the plugin; `prov.micro_batch(ids)` around a micro-batch says
its boundaries explicitly.)

What survives `prepare`: DDP keeps the parameter objects (the Ledger looks at their storages again
at every forward) and calls the HF model's own forward, where the plugin's hooks are. Expert
parallelism (`recipe.parallel.ep` = the number of processes) shards the routed experts over the
processes; DDP must then leave them alone (each rank holds other experts) and their gradients,
which the all-to-all's backward already sums over every rank's tokens, are divided by the
process count: DDP's average of the dense gradients and the experts' then mean the same loss.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..adapters import IMPLEMENTATION, Adapter
from ..config import Recipe
from ..derive import PartialRecipe, derive_recipe
from ..parallel.checkpoint import expert_shards
from ..parallel.expert import expert_parallel
from ..runtime.provisioner import Provisioner
from .engines import engine, engine_budget


def apply(model: nn.Module, recipe: PartialRecipe = None, accelerator=None) -> Provisioner:
    """`bgl.apply` for a model `accelerator` will prepare (call it before `prepare`): `prepare_model`,
    then the Provisioner with this process's recipe."""
    return Provisioner(model, prepare_model(model, recipe, accelerator))


def prepare_model(model: nn.Module, recipe: PartialRecipe, accelerator) -> Recipe:
    """What a run of `recipe` (whatever it leaves out derived: `bgl.derive_recipe`) under
    `accelerator` needs with the plugin or without it: the recipe checked against the accelerator
    (no pipeline, dp = its processes, ep = 1 or its processes, and 1 under FSDP or DeepSpeed), its
    budget the sharding engine's (`engines.engine_budget`, which refuses FSDP's activation
    checkpointing: two owners of recompute), and under expert parallelism the experts sharded over
    the processes for DDP. Returns this process's recipe (its `ep_rank`)."""
    if accelerator is None:
        raise ValueError("integrations.accelerate: pass the Accelerator that will prepare the model")
    budget = engine_budget(accelerator.state, model)
    recipe = derive_recipe(model, recipe, accelerator=accelerator, budget=budget)
    n, rank = accelerator.num_processes, accelerator.process_index
    par, pipe = recipe.parallel, recipe.pipeline
    problems = []
    if pipe.pp != 1:
        problems.append(f"pipeline.pp={pipe.pp}: Accelerate runs no pipeline, set it to 1")
    if par.dp != n:
        problems.append(f"parallel.dp={par.dp}, but Accelerate runs {n} processes: they must be equal")
    if par.ep not in (1, n):
        problems.append(f"parallel.ep={par.ep}: expert parallelism runs over all {n} processes or none (1)")
    elif par.ep > 1 and (sharding := engine(accelerator.state)) is not None:
        problems.append(
            f"parallel.ep={par.ep}: expert parallelism runs inside DistributedDataParallel, but Accelerate runs "
            f"{sharding}, which shards the experts itself; drop parallel.ep"
        )
    if problems:
        raise ValueError("bagualu accelerate: " + "; ".join(problems))
    if par.ep == 1 or Adapter(model).expert_group is not None:
        return recipe
    shard_experts_for_ddp(model)
    return recipe.model_copy(update={"parallel": par.model_copy(update={"ep_rank": rank})})


def shard_experts_for_ddp(model: nn.Module) -> None:
    """Expert parallelism over every process of the world, inside DDP (call it before DDP wraps
    `model`): the routed experts sharded (`bgl.expert_parallel`, on the "bagualu" experts, the
    only ones that dispatch), left alone by DDP (each rank holds other experts), and their
    gradients, which the all-to-all's backward already sums over every rank's tokens, divided by
    the process count: DDP's average of the dense gradients and the experts' then mean the same loss."""
    Adapter(model).model.set_experts_implementation(IMPLEMENTATION)
    expert_parallel(model)
    processes = torch.distributed.get_world_size()
    experts = expert_shards(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(experts))
    for name in experts:
        weight = model.get_parameter(name)
        if weight.requires_grad:  # frozen under LoRA: no gradient to average
            weight.register_hook(lambda grad: grad / processes)
