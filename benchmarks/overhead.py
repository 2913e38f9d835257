"""The plugin's tax: what `bgl.apply` costs a job that never needs it. At an ample capacity
(nothing to mitigate: every plan is empty) each model trains the same iterations twice over,
alternating iteration by iteration between two copies of it (same weights, same batches), the
first of each pair swapping each time: one with the plugin installed (the Provisioner's budgets,
plans, gate monitor, saved-tensor hooks and Ledger), one plain. Each iteration (in a Trainer row,
each optimizer step) is timed alone, the garbage collector frozen after set-up and collecting between iterations
(`collector.ManualCollector`), and the ratio of the medians says what the plugin costs; the
planner's share is its decision time over the plugin run's time.

Models: the demo's (the built-in `demo` recipe's tiny GLM-4-MoE, on its 4 expert-parallel gloo
processes, pipeline rank 0 of 4, each iteration the slowest rank's) and a larger Qwen3-MoE on one
process (hidden 512, 8 layers, 16 experts top-4, 4 micro-batches of 2 x 256 tokens), where
compute dominates as it does on real models: through the plugin's 1F1B driver (`bgl.apply`, pipeline
rank 0 of 4), and under HF's Trainer with `BagualuCallback` against a plain Trainer (no pipeline,
the zero-configuration path: the recipe derived, the micro-batches found on the model; a training
step there includes the optimizer's), in one process (also fed as SFTTrainer feeds it: texts of
log-normal lengths up to 256 tokens padded by TRL's default collator to each micro-batch's longest,
a new shape almost every micro-batch) and per engine that runs on CPU: DDP over 2
gloo processes, the routed experts sharded over them (expert parallelism inside DDP), and
DeepSpeed ZeRO-2 and ZeRO-3 over 2 processes (its CPU accelerator; `accelerate launch` with
DeepSpeed's plugin, one launch per copy, the two taking turns step by step). Under ZeRO-3 the
planner's time includes the ranks' agreement on what they recompute (`parallel.lockstep`).

    python benchmarks/overhead.py [--iterations 8] [--json FILE] [--only TEXT]   (~30 min on 2 CPU cores)

Each row is printed (and written to the JSON) as it completes; a row whose engine is not installed
(DeepSpeed, which the README installs apart) is skipped with its reason, and a row that fails fails
alone: the others run, and the exit status says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import bagualu_plugin as bgl
from bagualu_plugin.adapters import tiny_model
from bagualu_plugin.collector import ManualCollector
from bagualu_plugin.costmodel import ModelDims
from bagualu_plugin.demo.collectives import max_over_ranks
from bagualu_plugin.demo.model import rank_batches, rank_model
from bagualu_plugin.parallel.launch import free_port, run_ranks
from bagualu_plugin.report import table
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.stage import Stage

AMPLE = 100  # capacity: this many unmitigated micro-batches


def _turns(i: int) -> tuple[str, str]:
    """The copies' order in turn `i`: they swap who goes first each time, so that what the first
    (or the second) of a pair pays, both pay alike."""
    return ("plugin", "plain") if i % 2 == 0 else ("plain", "plugin")


def _alternate(make, batches, recipe, iterations: int, barrier=lambda: None, slowest=lambda t: t) -> dict:
    """`iterations` (after one warm-up each) of the plugin's copy and the plain one, taking turns."""
    plain, ours = make(), make()
    ours.load_state_dict(plain.state_dict())
    prov = bgl.apply(ours, recipe)
    schedule = prov.stage.schedule
    times = {"plugin": [], "plain": []}
    copies = {"plugin": (ours, prov), "plain": (plain, None)}
    try:
        with ManualCollector() as collector:
            for it in range(iterations + 1):
                for name in _turns(it):
                    model, provisioner = copies[name]
                    barrier()
                    start = time.perf_counter()
                    run_iteration(model, batches, schedule, provisioner)
                    elapsed = slowest(time.perf_counter() - start)
                    model.zero_grad(set_to_none=True)
                    collector.step()
                    if it:
                        times[name].append(elapsed)
                if it == 0:
                    planner_s, forwards = prov.planner_s, prov.forwards
        mitigated = sum(bool(e.plan) or bool(e.escalations) for e in prov.events)
        planner = (prov.planner_s - planner_s) / (prov.forwards - forwards)  # after the warm-up
    finally:
        prov.remove()
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    return {"times": times, "planner_s_per_micro_batch": planner, "mitigated_micro_batches": mitigated,
            "micro_batches": len(batches), "tokens": sum(ids.numel() for ids in batches) * ranks}


def _ample(recipe, cost) -> object:
    keep = cost.activation_bytes(recipe.batch.tokens, seq_len=recipe.batch.seq_len)
    hardware = recipe.hardware.model_copy(update={"capacity_bytes": AMPLE * keep})
    return recipe.model_copy(update={"hardware": hardware})


def _demo_rank(rank: int, size: int, iterations: int) -> dict:
    torch.set_num_threads(1)
    recipe = bgl.load_recipe("demo")
    recipe = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"ep_rank": rank})})
    recipe = _ample(recipe, Stage.of(recipe).cost)

    return _alternate(lambda: rank_model(recipe.model), rank_batches(recipe, rank), recipe, iterations, dist.barrier, max_over_ranks)


BATCH, SEQ, M = 2, 256, 4  # the larger model's micro-batches: 512 tokens each, 4 per step
STEPS = 4  # optimizer steps per Trainer.train(), the first not timed


def _make_larger():
    return tiny_model(
        "qwen3_moe", hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        intermediate_size=1024, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4, vocab_size=1024,
    )


def _larger(iterations: int) -> dict:
    make = _make_larger
    model = make()
    batch, seq, m = BATCH, SEQ, M
    recipe = bgl.Recipe.from_dict({
        "hardware": {"preset": "cpu", "capacity_bytes": 1},
        "model": ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa").model_dump(),
        "pipeline": {"pp": 4, "rank": 0, "micro_batches": m},
        "batch": {"seq_len": seq, "micro_batch_size": batch},
        "budget": {"non_activation_bytes": 0},
    })
    recipe = _ample(recipe, Stage.of(recipe).cost)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (batch, seq), generator=g) for _ in range(m)]
    return _alternate(make, batches, recipe, iterations)


def _step_clock(collector: ManualCollector, turns: tuple | None = None):
    """A Trainer callback timing each optimizer step and collecting garbage after it. With `turns`
    (a `TCPStore` and this copy's name), each step waits for the benchmark to hand this copy its
    turn and hands its time back: two launches take turns step by step (`_zero`)."""
    from transformers import TrainerCallback

    store, name = turns or (None, None)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            if store:
                store.wait([f"{name}/go/{len(self.times)}"])
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            elapsed = time.perf_counter() - self.start
            collector.step()  # before the turn goes back: the other copy's step runs alone
            if store:
                store.set(f"{name}/time/{len(self.times)}/{args.process_index}", repr(elapsed))
            self.times.append(elapsed)

    return StepClock()


def _make_trainer(model, out: str, steps: int, callbacks: list, churn: bool = False):
    """The HF Trainer of the Trainer rows: `steps` optimizer steps of M accumulated micro-batches
    of BATCH x SEQ random tokens (the same on every copy), nothing logged or saved. `churn`: texts
    of log-normal lengths up to SEQ (median SEQ / 2) batched by TRL's default collator, which pads
    each micro-batch to its longest: a new shape almost every micro-batch, as SFTTrainer makes them."""
    from transformers import PrinterCallback, Trainer, TrainingArguments
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    g = torch.Generator().manual_seed(0)
    texts = steps * BATCH * M
    if churn:
        lengths = [min(SEQ, max(8, round(SEQ / 2 * math.exp(0.6 * float(z))))) for z in torch.randn(texts, generator=g)]
        dataset = [{"input_ids": torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()} for n in lengths]
        collator = DataCollatorForLanguageModeling(pad_token_id=0)  # it makes the labels, the padding masked
    else:
        rows = [torch.randint(0, model.config.vocab_size, (SEQ,), generator=g) for _ in range(texts)]
        dataset, collator = [{"input_ids": ids, "labels": ids} for ids in rows], None
    arguments = TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=M, max_steps=steps, learning_rate=1e-4,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset, data_collator=collator, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # each train()'s summary line would break the table
    return trainer


def _ample_recipe(model) -> dict:
    """The callback's recipe at ample capacity; the rest it derives from the model and the Trainer."""
    from bagualu_plugin.adapters.costs import model_cost

    keep = model_cost(model).activation_bytes(BATCH * SEQ, seq_len=SEQ)
    return {"hardware": {"capacity_bytes": AMPLE * keep}, "budget": {"non_activation_bytes": 0}}


def _planner(events) -> dict:
    """The planner's time and the mitigated micro-batches over the timed steps' `events`."""
    return {"planner_s": sum(e.planner_s for e in events), "forwards": len(events), "tokens": sum(e.tokens for e in events),
            "mitigated": sum(bool(e.plan) or bool(e.escalations) for e in events)}


def _trainer(iterations: int, ep: bool = False, churn: bool = False) -> dict:
    """The larger model under HF's Trainer as its users run it, with `BagualuCallback` (the plugin
    derives its recipe from the model and the training arguments, and finds each micro-batch on
    the model) and without. Two Trainers of equal copies take turns: each `train()` runs STEPS
    optimizer steps of M accumulated micro-batches and all but the first are timed (the first pays
    `train()`'s set-up: the optimizer, the data loader, the plugin's install). In a process group
    (`_trainer_rank`) each Trainer wraps its copy in DDP; `ep`: the routed experts sharded over
    the processes (the plain copy's as the callback shards them)."""
    from bagualu_plugin.integrations.accelerate import shard_experts_for_ddp
    from bagualu_plugin.integrations.transformers import BagualuCallback

    plain = _make_larger()
    ours = _make_larger()
    ours.load_state_dict(plain.state_dict())
    recipe = _ample_recipe(plain)
    if ep:
        recipe["parallel"] = {"ep": dist.get_world_size()}
        for model in (plain, ours):
            model.set_experts_implementation("bagualu")
        shard_experts_for_ddp(plain)  # the callback shards its own copy at the Trainer's init
    callback = BagualuCallback(recipe)
    times = {"plugin": [], "plain": []}
    planner = {"planner_s": 0, "forwards": 0, "tokens": 0, "mitigated": 0}
    with tempfile.TemporaryDirectory() as out, ManualCollector() as collector:
        clocks = {name: _step_clock(collector) for name in times}
        trainers = {
            "plugin": _make_trainer(ours, out, STEPS, [callback, clocks["plugin"]], churn),
            "plain": _make_trainer(plain, out, STEPS, [clocks["plain"]], churn),
        }
        for i in range(iterations):
            for name in _turns(i):
                trainers[name].train()
                times[name] += clocks[name].times[1 - STEPS:]
            # this train()'s provisioner: the timed steps' forwards are its last M each
            for key, value in _planner(list(callback.provisioner.events)[M - M * STEPS:]).items():
                planner[key] += value
    steps = planner["forwards"] / M  # timed, each of M micro-batches: their padded tokens per step, on average
    return {"times": times, "planner_s_per_micro_batch": planner["planner_s"] / planner["forwards"],
            "mitigated_micro_batches": planner["mitigated"], "micro_batches": M,
            "tokens": planner["tokens"] / steps * (dist.get_world_size() if dist.is_initialized() else 1)}


def _trainer_rank(rank: int, size: int, iterations: int, ep: bool) -> dict:
    """`_trainer` on one of `size` gloo processes, which accelerate takes for a CPU launch (it
    reads the launcher's variables); each step's time is the slowest process's."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    out = _trainer(iterations, ep)
    out["times"] = {name: [max_over_ranks(t) for t in times] for name, times in out["times"].items()}
    return out


ZERO_PROCESSES = 2


def _zero(stage: int, iterations: int) -> dict:
    """The Trainer rows under DeepSpeed ZeRO `stage` over ZERO_PROCESSES processes, each copy in an
    `accelerate launch` of its own (accelerate holds one DeepSpeed engine per process): the
    launches run side by side and take turns step by step, this process handing out the turns
    through a `TCPStore`; as many timed steps as the in-process rows, after one warm-up step.
    Each step's time is the slowest process's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import ACCELERATE_LAUNCH, accelerate_config, kill_session, launched_env  # the tests' launch, shared

    steps = 1 + (STEPS - 1) * iterations
    names = ("plugin", "plain")
    times = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
        config = accelerate_config(folder, ZERO_PROCESSES, zero={"stage": stage})
        launches, logs = {}, {name: open(folder / f"{name}.log", "w") for name in names}
        try:
            for name, log in logs.items():
                launches[name] = subprocess.Popen(
                    [*ACCELERATE_LAUNCH, "--config_file", str(config), "--main_process_port", str(free_port()), __file__,
                     "--zero-worker", name, "--store-port", str(store.port), "--steps", str(steps), "--out", str(folder)],
                    env=launched_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
            deadline = time.monotonic() + 900
            for step in range(steps):
                for name in _turns(step):
                    store.set(f"{name}/go/{step}", "")
                    keys = [f"{name}/time/{step}/{rank}" for rank in range(ZERO_PROCESSES)]
                    while not store.check(keys):
                        if launches[name].poll() is not None or time.monotonic() > deadline:
                            tail = (folder / f"{name}.log").read_text()[-4000:]
                            raise RuntimeError(f"the {name} launch under ZeRO-{stage} stopped at step {step} "
                                               f"(exit {launches[name].returncode}):\n{tail}")
                        time.sleep(0.02)  # the steps are timed in the launches: this wait adds nothing to them
                    if step:
                        times[name].append(max(float(store.get(key)) for key in keys))
            for name, launch in launches.items():
                if launch.wait(timeout=120):
                    raise RuntimeError(f"the {name} launch exited {launch.returncode}:\n{(folder / f'{name}.log').read_text()[-4000:]}")
        finally:
            for launch in launches.values():
                kill_session(launch)
            for log in logs.values():
                log.close()
        planner = json.loads((folder / "planner.json").read_text())
    return {"times": times, "planner_s_per_micro_batch": planner["planner_s"] / planner["forwards"],
            "mitigated_micro_batches": planner["mitigated"], "micro_batches": M, "tokens": BATCH * SEQ * M * ZERO_PROCESSES}


def _zero_worker(name: str, store_port: int, steps: int, out: str) -> None:
    """One process of `_zero`'s launch of copy `name`: the Trainer taking its turns, with the
    callback for "plugin" (whose first process writes the planner's figures to `out`)."""
    from bagualu_plugin.integrations.transformers import BagualuCallback

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    model = _make_larger()  # seeded: the same weights in every process of both launches
    callback = BagualuCallback(_ample_recipe(model)) if name == "plugin" else None
    with ManualCollector() as collector:
        trainer = _make_trainer(model, out, steps, [c for c in (callback, _step_clock(collector, (store, name))) if c])
        trainer.train()
    if callback and trainer.args.process_index == 0:
        (Path(out) / "planner.json").write_text(json.dumps(_planner(list(callback.provisioner.events)[M:])))


def _row(name: str, r: dict) -> dict:
    """One model's figures: the ratio of the copies' median iterations and its spread, the
    planner's share of the plugin copy's time."""
    plugin, plain = (statistics.median(r["times"][k]) for k in ("plugin", "plain"))
    ratios = [b / a for a, b in zip(r["times"]["plugin"], r["times"]["plain"])]
    return {"model": name, "seconds_plugin": plugin, "seconds_plain": plain, "tokens_per_s_plugin": r["tokens"] / plugin,
            "tokens_per_s_plain": r["tokens"] / plain, "ratio": plain / plugin, "ratio_min": min(ratios), "ratio_max": max(ratios),
            "planner_share": r["planner_s_per_micro_batch"] * r["micro_batches"] / plugin,
            "mitigated_micro_batches": r["mitigated_micro_batches"]}


def _cells(row: dict) -> list:
    if "ratio" not in row:
        return [row["model"], *["-"] * 5, row.get("skipped") or row["failed"]]
    return [row["model"], f"{row['seconds_plugin']:.3f}", f"{row['seconds_plain']:.3f}", f"{row['ratio']:.3f}x",
            f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}x", f"{100 * row['planner_share']:.2f}%", row["mitigated_micro_batches"]]


HEADERS = ["model", "s/iteration, plugin", "s/iteration, plain", "plugin / plain tokens/s", "per-iteration spread", "planner share",
           "mitigated mbs"]


def measure(rows: list[tuple[str, tuple[str, ...], Callable[[], dict]]], json_path: str | None) -> list[dict]:
    """Each row in turn: skipped with its reason where an engine it needs is not installed (as the
    tests skip), its error kept where it fails (the others still run), printed as it completes
    and written with the rows before it (`json_path`), so that a row that fails late loses nothing
    measured before it."""
    out = []
    for name, needs, run in rows:
        missing = [module for module in needs if importlib.util.find_spec(module) is None]
        if missing:
            out.append({"model": name, "skipped": f"skipped: {', '.join(missing)} not installed"})
        else:
            try:
                out.append(_row(name, run()))
            except Exception as exc:  # noqa: BLE001 - one row's failure is that row's; the exit status says so
                traceback.print_exc()
                out.append({"model": name, "failed": f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"})
        print(" | ".join(map(str, _cells(out[-1]))), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(out, f, indent=1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--iterations", type=int, default=8,
        help=f"measured iterations of each copy (after one warm-up); a Trainer row's is a train() of {STEPS} steps, {STEPS - 1} timed",
    )
    parser.add_argument("--json", default=None, help="also write the rows as JSON, each as it completes")
    parser.add_argument("--only", default="", help="measure only the rows whose name contains this text")
    for worker in ("--zero-worker", "--store-port", "--steps", "--out"):  # a ZeRO row's launched process (`_zero`)
        parser.add_argument(worker, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.zero_worker:
        _zero_worker(args.zero_worker, int(args.store_port), int(args.steps), args.out)
        return 0
    if args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    demo = bgl.load_recipe("demo")
    n = args.iterations
    rows = [
        (f"demo GLM-4-MoE, {demo.parallel.ep} EP ranks", (), lambda: run_ranks(_demo_rank, demo.parallel.ep, n, timeout_s=900)[0]),
        ("Qwen3-MoE hidden 512 x 8 layers, 512 tokens/mb", (), lambda: _larger(n)),
        ("the same, HF Trainer + BagualuCallback", (), lambda: _trainer(n)),
        ("the same, Trainer, TRL's collator: a new padded length each micro-batch", ("trl",), lambda: _trainer(n, churn=True)),
        ("the same, Trainer, DDP over 2 processes", (), lambda: run_ranks(_trainer_rank, 2, n, False, timeout_s=900)[0]),
        ("the same, Trainer, experts over 2 processes", (), lambda: run_ranks(_trainer_rank, 2, n, True, timeout_s=900)[0]),
        *[(f"the same, Trainer, ZeRO-{stage} over {ZERO_PROCESSES} processes", ("accelerate", "deepspeed"),
           lambda stage=stage: _zero(stage, n)) for stage in (2, 3)],
    ]
    out = measure([row for row in rows if args.only in row[0]], args.json)
    print("\n" + table(HEADERS, [_cells(row) for row in out]))
    return 1 if any("failed" in row for row in out) else 0


if __name__ == "__main__":
    sys.exit(main())
