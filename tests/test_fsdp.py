"""FSDP2 (torch's `fully_shard`, what accelerate's FSDP2 applies) over 2 gloo processes on CPU:
the plugin installed before the model is sharded, as before `accelerator.prepare`. The Ledger
never counts the sharded or the gathered parameters (FSDP2 gathers a module's whole parameters in
its forward pre-hook, and its ops save views of them), so each micro-batch keeps exactly what the
same micro-batch keeps unsharded, whole or planned, and the loss is the same bit for bit. The
checks share one launch of the 2 ranks (`helpers.run_jobs`)."""

import contextlib
import gc

import pytest
import torch
from helpers import run_jobs, tiny_recipe

import bagualu_plugin as bgl
from bagualu_plugin.adapters import Adapter, tiny_model
from bagualu_plugin.config import Recipe
from bagualu_plugin.runtime.plan_runtime import apply_plan

SEQ, MBS = 32, 2

pytestmark = pytest.mark.multiprocess  # every test runs 2 gloo ranks (`run_ranks`)
CAPACITIES = {"kept": 4.0, "planned": 0.7}
UNITS = ["decoder layers", "attention and MoE block"]


def _recipe(model, capacity: float) -> Recipe:
    """Capacity as a multiple of one unmitigated micro-batch."""
    return tiny_recipe(
        model, seq_len=SEQ, micro_batch_size=MBS, capacity=capacity, parallel={"dp": 2}, pipeline={"pp": 1, "micro_batches": 1},
        strategies={"allowed": ["recompute", "offload"]},
    )


def _micro_batch(rank: int, size: int, capacity: float, fused: bool = False) -> dict:
    """`fused`: TRL's fused LM head, sharded as accelerate shards it (the embedding, then the final
    norm and the LM head together, kept gathered from forward to backward): the head's weight is
    then a gathered parameter that TRL's function saves without calling the head's forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trl.trainer.utils import add_fused_lm_head

    ids = torch.randint(0, 128, (MBS, SEQ), generator=torch.Generator().manual_seed(rank))
    out = {}
    for sharded in (False, True):
        model = tiny_model("qwen3_moe", num_hidden_layers=4)
        model.set_experts_implementation("bagualu")
        if fused:
            add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer adds it
        prov = bgl.apply(model, _recipe(model, capacity))
        if sharded:
            mesh = init_device_mesh("cpu", (size,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            if fused:
                fully_shard(model.model.embed_tokens, mesh=mesh)
                fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
            fully_shard(model, mesh=mesh)
        # the explicit block knows the mask, not TRL's head: the plugin finds such a micro-batch itself
        with contextlib.nullcontext() if fused else prov.micro_batch(ids):
            loss = model(input_ids=ids, labels=ids, **({"fused_lm_head": True} if fused else {})).loss
            loss.backward()
        event = prov.events[-1]
        out[sharded] = (event.actual, event.plan, loss.detach())
        out["misses"] = out.get("misses", []) + list(event.misses)
        prov.remove()
        if sharded:  # the Ledger's hooks go with it: the next forward finds it gone and removes them
            layer = model.model.layers[0]
            hooks = (len(layer._forward_pre_hooks), len(layer._forward_hooks))
            del prov, event
            gc.collect()
            with torch.no_grad():
                model(input_ids=ids)
            out["hooks removed"] = (hooks[0] - len(layer._forward_pre_hooks), hooks[1] - len(layer._forward_hooks))
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[str, list]:
    """Every case of both tests below, in one launch: each job's results in rank order."""
    jobs = {name: (_micro_batch, capacity) for name, capacity in CAPACITIES.items()}
    jobs["fused head"] = (_micro_batch, CAPACITIES["planned"], True)
    jobs["lockstep"] = (_lockstep,)
    return run_jobs(2, {**jobs, **{units: (_all_gathers, units) for units in UNITS}}, timeout_s=120)


@pytest.mark.parametrize("case", list(CAPACITIES))
def test_the_ledger_counts_activations_only_under_fsdp2(ranks, case):
    capacity = CAPACITIES[case]
    for rank in ranks[case]:
        (plain, plan, loss), (sharded, sharded_plan, sharded_loss) = rank[False], rank[True]
        assert sharded == plain and sharded_plan == plan and torch.equal(sharded_loss, loss)
        assert bool(plan) == (capacity < 1)
        assert rank["hooks removed"] == (1, 1)  # the Ledger's two, FSDP2's own kept


def test_trl_fused_head_under_accelerate_s_sharding_keeps_what_it_keeps_unsharded(ranks):
    """accelerate shards the final norm and the LM head as one group that stays gathered until
    backward; TRL's fused head saves the head's gathered weight, never calling the head. Found on
    a GPU, where the Ledger counted that weight as an activation (32 KiB here; the whole
    vocabulary projection of a real model) and the cost model's check reported the head."""
    for rank in ranks["fused head"]:
        (plain, plan, loss), (sharded, sharded_plan, sharded_loss) = rank[False], rank[True]
        assert sharded == plain and sharded_plan == plan and plan and torch.equal(sharded_loss, loss)
        assert rank["misses"] == [], rank["misses"]


def _all_gathers(rank: int, size: int, units: str) -> dict:
    """FSDP2's all-gathers in one micro-batch's forward and backward, per plan (torch 2.13 issues
    them through torch.distributed.all_gather_single)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ids = torch.randint(0, 128, (MBS, SEQ), generator=torch.Generator().manual_seed(rank))
    model = tiny_model("qwen3_moe", num_hidden_layers=3)
    model.set_experts_implementation("bagualu")
    mesh = init_device_mesh("cpu", (size,))
    for layer in model.model.layers:
        if units == "attention and MoE block":
            fully_shard(layer.self_attn, mesh=mesh)
            fully_shard(layer.mlp, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layer_ops = Adapter(model).ops()
    plans = {
        "none": {},
        "per op": {op: "recompute" for op in layer_ops if op.name in ("attn_core", "expert_act")},
        "whole layers": {op: "recompute" for op in layer_ops if op.layer >= 1},
    }
    original, counts = torch.distributed.all_gather_single, {}

    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    torch.distributed.all_gather_single = counted
    try:
        for name, plan in plans.items():
            counts[name] = 0
            with apply_plan(model, plan):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    finally:
        torch.distributed.all_gather_single = original
    return counts


@pytest.mark.parametrize("units", UNITS)
def test_recompute_adds_no_all_gather_under_fsdp2(ranks, units):
    """Why the cost model prices recompute under FSDP with no communication: a region replays
    modules whose FSDP unit backward gathers anyway, at most earlier (a whole layer's replay
    gathers its inner units, whose backward then finds them gathered)."""
    for counts in ranks[units]:
        assert counts["none"] > 0 and counts["per op"] == counts["whole layers"] == counts["none"], counts


def _lockstep(rank: int, size: int) -> dict:
    """`parallel.lockstep` on each rank: the group of a full-sharding recipe, the plans after
    `recomputed_anywhere` from plans that differ per rank, an escalation one rank asks for."""
    from bagualu_plugin.costmodel import OpId
    from bagualu_plugin.costmodel.plan import Plan
    from bagualu_plugin.parallel.expert import any_rank
    from bagualu_plugin.parallel.lockstep import lockstep_group, recomputed_anywhere

    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    groups = {}
    for name, sections in {"fsdp": {"budget": {"fsdp": True}}, "ddp": {}, "pipeline": {"budget": {"fsdp": True}}}.items():
        pipeline = {"pp": 2 if name == "pipeline" else 1, "micro_batches": 2}
        recipe = tiny_recipe(model, seq_len=SEQ, micro_batch_size=MBS, pipeline=pipeline, **sections)
        try:
            groups[name] = lockstep_group(recipe) is torch.distributed.group.WORLD
        except ValueError as error:
            groups[name] = str(error)
    ops = Adapter(model).ops()
    mine = [{OpId(0, "attn_core"): "recompute"}, {OpId(0, "attn_core"): "offload", OpId(1, "expert_fc1"): "offload"}][rank]
    plan = recomputed_anywhere(Plan(mine), ops, torch.distributed.group.WORLD, torch.device("cpu"))
    return {"groups": groups, "plan": plan.named(), "asked": any_rank(rank == 0, torch.distributed.group.WORLD, torch.device("cpu"))}


def test_the_ranks_recompute_in_lockstep_under_full_sharding(ranks):
    """Under a full-sharding engine over several processes a region's replay gathers weights
    (ZeRO-3 gathers every module, FSDP2 a unit a whole layer's replay reaches before backward
    would), so the ranks recompute the same ops: each takes every op another recomputes (its own
    offloads stay), and an escalation one rank asks for is every rank's. Refused with a pipeline,
    whose data-parallel group the plugin does not know; nothing to agree on without sharding."""
    for rank, found in enumerate(ranks["lockstep"]):
        assert found["groups"]["fsdp"] is True and found["groups"]["ddp"] is False
        assert "budget.fsdp with pipeline.pp=2" in found["groups"]["pipeline"] and "pipeline.pp must be 1" in found["groups"]["pipeline"]
        assert found["plan"] == ({"0.attn_core": "recompute"} if rank == 0 else {"0.attn_core": "recompute", "1.expert_fc1": "offload"})
        assert found["asked"] is True
