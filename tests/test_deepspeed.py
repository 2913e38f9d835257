"""DeepSpeed ZeRO over gloo processes on CPU (DeepSpeed's CPU accelerator): under `bgl.apply` with
`deepspeed.initialize`, and under the Trainer as `accelerate launch --config_file` runs it with a
DeepSpeed plugin and as the Trainer's own `deepspeed` argument runs it under torchrun (at the end
of this file). The recipe prices each rank's
static bytes from the engine's own config (`zero_budget`, as the Trainer path does), and the
shards and reduce buckets it prices are the ones DeepSpeed really holds: stage 2's optimizer
partition and stage 3's weight partitions each hold half the parameters on each rank, and each
stage its 2 GB bucket (DeepSpeed's default size; only the pages its gradients fill become resident). ZeRO-3 gathers each module's
parameters into new storages in its forward pre-hooks, with every parameter partitioned
(`stage3_param_persistence_threshold: 0`): the Ledger never counts them, so each micro-batch
keeps what its cost model says (no miss). Under a capacity below the peak of the same run at
ample memory, plans keep the peak under it, and the losses and the final weights are bitwise
those of the same engine without the plugin. The plugin installed before `deepspeed.initialize`
(the engine's hooks come later) and after it. Needs DeepSpeed, which PyPI ships as source only:
the test command builds it (`DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`)."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from helpers import accelerate_config, deepspeed_config, launch_example, run_jobs, tiny_recipe  # noqa: E402

import bagualu_plugin as bgl  # noqa: E402
from bagualu_plugin.adapters import tiny_model  # noqa: E402
from bagualu_plugin.integrations.engines import parameter_bytes, zero_budget  # noqa: E402
from bagualu_plugin.report import read_run  # noqa: E402
from bagualu_plugin.runtime.ledger import _storage  # noqa: E402
from bagualu_plugin.stage import Stage  # noqa: E402

pytestmark = pytest.mark.multiprocess
SEQ, MBS, STEPS = 16, 2, 3
FP32 = {"weight_bytes_per_param": 4}  # the tiny model's weights, for the unsharded reference
AMPLE = 100.0  # capacity, in unmitigated micro-batches: nothing planned


def _storages() -> dict:
    """Every tensor storage alive in this process, by key, and its bytes."""
    gc.collect()
    return dict(found for t in gc.get_objects() if isinstance(t, torch.Tensor) and (found := _storage(t)))


def _train(rank: int, size: int, stage: int, plugin: str, capacity: float = 0.7) -> dict:
    """`STEPS` ZeRO steps of a tiny Qwen3-MoE; `plugin`: "none", "before" or "after" `initialize`;
    `capacity`: the static bytes priced for the engine plus that many unmitigated micro-batches."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(size))  # as a launcher sets them
    deepspeed.init_distributed(dist_backend="gloo")  # on the ranks' group
    config = {
        "train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "train_batch_size": MBS * size,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    torch.manual_seed(0)
    before = _storages()  # the jobs that ran before in this process (their results) are not this engine's
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    shape = {"seq_len": SEQ, "micro_batch_size": MBS, "parallel": {"dp": size}, "pipeline": {"pp": 1, "micro_batches": 1}}
    priced = {"budget": {**zero_budget(config, param_bytes=parameter_bytes(model)), "non_activation_bytes": "auto"}}  # as the callback
    ours = Stage.of(tiny_recipe(model, **shape, **priced))
    static, cost = ours.static_bytes, ours.cost
    activations = tiny_recipe(model, **shape, capacity=capacity).hardware.capacity_bytes
    recipe = tiny_recipe(model, **shape, **priced, capacity_bytes=static + activations, strategies={"allowed": ["recompute", "offload"]})
    plain = {**FP32, "non_activation_bytes": "auto", "shard_optimizer": False}
    unsharded = Stage.of(tiny_recipe(model, **shape, budget=plain)).static_bytes
    prov = bgl.apply(model, recipe) if plugin == "before" else None
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    if plugin == "after":
        prov = bgl.apply(model, recipe)
    ids = torch.randint(0, 128, (MBS, SEQ), generator=torch.Generator().manual_seed(100 + rank))
    buckets = []  # the reduce buckets' bytes as the last gradient of each backward comes (the embedding's)

    def measure(_):
        found = (b for bucket in engine.optimizer.ipg_buckets.values() for b in ([bucket.buffer] if stage == 3 else bucket.buffer))
        buckets.append(sum(b.numel() * b.element_size() for b in found))

    model.model.embed_tokens.weight.register_post_accumulate_grad_hook(measure)
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=ids, labels=ids.clone()).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    del loss
    held = sum(n for key, n in _storages().items() if key not in before)  # what the engine keeps between steps
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = list(model.parameters())
    shards = [p.ds_tensor.numel() for p in params] if stage == 3 else [t.numel() for t in engine.optimizer.single_partition_of_fp32_groups]
    count = sum(p.ds_numel if stage == 3 else p.numel() for p in params)
    out = {"losses": losses, "weights": weights, "shard": sum(shards), "params": count,
           "released": stage == 3 and all(p.numel() == 0 for p in params), "unsharded": unsharded, "static": static, "held": held,
           "buckets": buckets, "priced_buckets": zero_budget(config)["engine_buffer_bytes"],
           "gathered": 2 * 4 * max(cost.blocks[i].dense_params + cost.blocks[i].expert_params for i in cost.layers)}
    if prov is not None:
        out.update(
            misses=[m for e in prov.events for m in e.misses], planned=sum(bool(e.plan) for e in prov.events),
            peak=prov.peak_device_bytes, capacity=prov.stage.capacity, events=len(prov.events), provisioned=prov.stage.static_bytes,
        )
        prov.remove()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    jobs = {f"{stage}-{plugin}": (_train, stage, plugin) for stage in (2, 3) for plugin in ("none", "before", "after")}
    jobs |= {f"{stage}-ample": (_train, stage, "before", AMPLE) for stage in (2, 3)}
    return run_jobs(2, jobs, timeout_s=120)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("plugin", ["before", "after"])
def test_zero_trains_bitwise_under_plans_with_the_ledger_on_the_cost_model(runs, stage, plugin):
    for ours, stock, ample in zip(runs[f"{stage}-{plugin}"], runs[f"{stage}-none"], runs[f"{stage}-ample"]):
        assert ours["losses"] == stock["losses"]
        assert all(torch.equal(ours["weights"][k], stock["weights"][k]) for k in stock["weights"])
        assert ours["events"] == STEPS and ours["planned"] == STEPS and ample["planned"] == 0  # the capacity forced a plan on each
        assert ours["misses"] == [] and ours["peak"] <= ours["capacity"] < ample["peak"]
        assert ours["provisioned"] == stock["static"]  # the engine's price, not a measure of the parameters


def test_the_static_bytes_priced_are_what_deepspeed_holds(runs):
    """Each rank holds half the parameters in its optimizer partition (stage 2) or weight
    partitions (stage 3, whose gathered weights are released after each module). The reduce
    buckets priced are those DeepSpeed allocates, live as the backward's last gradient comes
    (stage 2 frees them at the step, stage 3 keeps its one). What the stock engine keeps between
    steps is what is priced, less what a step gathers at stage 3 (two layers' weights) and, at
    stage 2, less its buckets, to 1 KiB: what is not a parameter's (the batch's token ids, the
    rotary table, the optimizer's step counters). In FP32 stage 2's master partition is the flat
    FP32 weights themselves, stage 3's a copy beside its weight partitions: priced so."""
    for stage in (2, 3):
        for rank in runs[f"{stage}-none"]:
            assert rank["shard"] == rank["params"] / 2 and rank["released"] == (stage == 3)
            assert rank["buckets"] == [rank["priced_buckets"]] * STEPS and rank["priced_buckets"] == 500_000_000 * 4
            unpriced = rank["gathered"] if stage == 3 else rank["priced_buckets"]
            assert 0 <= rank["held"] - (rank["static"] - unpriced) <= 1024  # the ids, the RoPE table, step counters
    two, three = (runs[f"{stage}-none"][0] for stage in (2, 3))
    shards = [r["static"] - r["priced_buckets"] for r in (two, three)]  # the buckets are the same
    # stage 2 shards the gradients and the moments; stage 3 the weights too, but in FP32 keeps its
    # master apart from them (stage 2's is the weights): a wash, less the layers a step gathers
    assert shards[1] - three["gathered"] == shards[0] < two["unsharded"]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_deepspeed_s_linear_keeps_frozen_inputs_as_the_cost_model_says(family, monkeypatch):
    """zero.Init puts ZeRO-3's memory-efficient linear in `F.linear`'s place and leaves it there
    (the Trainer's `from_pretrained` enters it under ZeRO-3): it keeps its input whenever it makes
    a graph node, so under LoRA a frozen router or LM head keeps what it does not under torch's
    (seen as a cost-model miss at every router, under ZeRO-3 with LoRA). `model_dims` reads it
    off `F.linear`; the Ledger counts what the cost model says under either linear."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from helpers import plan_step
    from peft import LoraConfig, get_peft_model

    from bagualu_plugin.adapters.costs import model_cost, model_dims

    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] if family == "deepseek_v3" else ["q_proj", "v_proj"]
    model = get_peft_model(tiny_model(family), LoraConfig(r=4, target_modules=targets))
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    kept = {}
    for name, linear in (("torch", torch.nn.functional.linear), ("deepspeed", zero3_linear_wrap)):
        monkeypatch.setattr(torch.nn.functional, "linear", linear)
        cost = model_cost(model)
        assert model_dims(model).zero3_linear == (name == "deepspeed")
        _, _, kept[name] = plan_step(model, ids, {}, backward=False)
        assert kept[name] == cost.activation_bytes(ids.numel(), seq_len=SEQ), name
    assert kept["deepspeed"] > kept["torch"]


# --------------------------------------------------------------- the Trainer, as accelerate launches it

WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens across ranks".split()
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + i % 9)) for i in range(32)]  # uneven lengths
# (trainer, LoRA, ZeRO stage, processes, family): ZeRO-3 for {SFTTrainer, Trainer} x {full, LoRA} with the
# last test of this file (SFTTrainer with LoRA, through the Trainer's own argument), and ZeRO-2
LAUNCHED = [("sft", False, 3, 2, "qwen3_moe"), ("hf", False, 3, 2, "glm4_moe"), ("hf", True, 3, 2, "deepseek_v3"),
            ("hf", True, 2, 2, "deepseek_v3")]


def _checkpoint(tmp: Path, family: str) -> tuple[Path, Path]:
    from bagualu_plugin.adapters.tiny import save_tiny, tiny_tokenizer

    model, corpus = save_tiny(family, tmp / family, num_hidden_layers=4), tmp / "corpus.txt"
    tiny_tokenizer().save_pretrained(model)
    corpus.write_text("\n".join(TEXTS))
    return model, corpus


@pytest.mark.parametrize(("trainer", "lora", "stage", "processes", "family"), LAUNCHED,
                         ids=[f"{t}-{'lora' if lora else 'full'}-zero{s}-{n}proc-{f}" for t, lora, s, n, f in LAUNCHED])
def test_the_trainer_under_accelerate_s_deepspeed_plugin(tmp_path, trainer, lora, stage, processes, family):
    """accelerate launch --config_file with DeepSpeed's plugin runs ZeRO under the Trainer on CPU
    (its CPU accelerator, gloo), as on GPUs: the run without the plugin first, then the plugin at
    93% of what that run needed (static bytes priced from the engine's config, as the plugin
    prices them). Losses and saved weights bitwise, the peak at or under the capacity, plans in
    force, no cost-model miss, each rank's recipe priced for the engine over 2 data-parallel ranks.
    SFTTrainer's fused LM head saves the LM head's weight, which ZeRO-3 gathers again in its
    backward by DeepSpeed's marks on it: it runs outside the plugin's saved-tensor hooks
    (`runtime.unhooked_head`; under them it failed: 'Tensor' object has no attribute 'ds_status').
    Under ZeRO-3 the two ranks' micro-batches differ in length, so their plans would differ: they
    recompute the same ops in every micro-batch (`parallel.lockstep`; without it a micro-batch
    that one rank recomputed and the other kept hung them in different collectives)."""
    model, corpus = _checkpoint(tmp_path, family)
    # every weight partitioned at stage 3 (no persistence threshold); a small bucket, so buckets fill more than once
    config = accelerate_config(tmp_path, processes, zero={"stage": stage, "reduce_bucket_size": 64 * 64,
                                                          "stage3_param_persistence_threshold": 0})
    common = ("--model", str(model), "--data", str(corpus), "--trainer", trainer, "--steps", "2", "--accumulation", "2",
              "--max-length", "40", *(("--lora",) if lora else ()))
    _planned_as_stock(tmp_path, config, common, processes, stage)


def _planned_as_stock(tmp_path: Path, launcher, common: tuple, processes: int, stage: int) -> None:
    """examples/sft_moe.py under `launcher` (`launch_example`) with the flags `common`: without
    the plugin, then with it at 93% of what that run needed; checked as the tests above say."""
    stock, unplanned, theirs = launch_example(launcher, tmp_path / "stock", *common, "--no-plugin")
    capacity = int(0.93 * unplanned["bagualu/unplanned_peak_device_bytes"])
    ours, figures, mine = launch_example(launcher, tmp_path / "ours", *common, "--capacity", str(capacity))
    assert ours == stock and mine.keys() == theirs.keys() and mine
    assert all(torch.equal(mine[f][k], theirs[f][k]) for f in theirs for k in theirs[f])
    assert figures["bagualu/peak_device_bytes"] <= capacity < unplanned["bagualu/unplanned_peak_device_bytes"]
    assert figures["bagualu/mitigated_ops"] > 0 and figures["bagualu/cost_model_misses"] == 0
    assert figures.get("bagualu/spilled_bytes", 0) == 0
    runs = list(read_run(tmp_path / "ours").values())  # each rank's events, in order
    if stage == 3 and processes > 1:
        assert any(len({e["tokens"] for e in mbs}) > 1 for mbs in zip(*runs))  # the ranks' micro-batches differ
        recomputed = [[({op for op, how in e["plan"].items() if how == "recompute"}, [x["layer"] for x in e["escalations"]])
                       for e in events] for events in runs]
        assert all(r == recomputed[0] for r in recomputed)
    for rank in range(processes):
        recipe = json.loads((tmp_path / "ours" / f"recipe-rank{rank}.json").read_text())
        assert recipe["parallel"]["dp"] == processes and recipe["budget"]["shard_gradients"]
        assert recipe["budget"]["fsdp"] == (stage == 3)


def test_the_trainers_own_deepspeed_argument(tmp_path):
    """The Trainer's own `deepspeed` argument (`TrainingArguments(deepspeed="ds_config.json")`,
    the example's `--deepspeed`) under torchrun on 2 processes: the Trainer makes accelerate's
    DeepSpeed plugin from the JSON, filling its "auto" values, and the callback prices that
    engine: here ZeRO-3 with the parameters and the optimizer state offloaded (the Trainer's
    AdamW on them, `zero_force_ds_cpu_optimizer: false`; DeepSpeed's own CPU Adam is an op it
    compiles), under SFTTrainer with LoRA. Checked as under accelerate's plugin."""
    model, corpus = _checkpoint(tmp_path, "mixtral")
    ds = deepspeed_config(tmp_path, {"stage": 3, "reduce_bucket_size": 64 * 64, "stage3_param_persistence_threshold": 0,
                                     "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
                          zero_force_ds_cpu_optimizer=False)  # the Trainer's AdamW, not DeepSpeed's compiled CPU Adam
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    common = ("--model", str(model), "--data", str(corpus), "--deepspeed", str(ds), "--lora", "--steps", "2",
              "--accumulation", "2", "--max-length", "40")
    _planned_as_stock(tmp_path, torchrun, common, 2, 3)
    for rank in (0, 1):
        budget = json.loads((tmp_path / "ours" / f"recipe-rank{rank}.json").read_text())["budget"]
        assert budget["offload_params"] and budget["offload_optimizer"]
