"""Fine-tune a saved HF MoE checkpoint with adaptive activation memory in a plain Accelerate loop,
under `python` or `accelerate launch` (DDP over the processes; expert parallelism when the
recipe's `parallel.ep` equals their number).

    accelerate launch --multi_gpu --num_processes 2 examples/finetune_moe.py \\
        --model CKPT --steps 20 --output-dir out [--capacity 40GiB] [--recipe R] [--data corpus.txt] [--no-adaptive | --oracle] \\
        [--report-to tensorboard]

The recipe is derived from the model, the device and the accelerator (`bgl.derive_recipe`); a
`--recipe` (a YAML file of any of its sections, or a built-in name) overrides what it gives, and
its `pipeline.micro_batches` and `batch` win over `--micro-batches`, `--batch-size` and
`--seq-len`. On CPU `--capacity` (or the recipe's `hardware.capacity_bytes`) is the simulated
device memory the plugin plans for. The loop has no plugin code in it: the plugin finds each
micro-batch on the model. `--no-adaptive` is the same run without the plugin: its activations are
counted, not limited, so the two runs compare step by step: the unbounded run, the fastest any
policy can be. `--oracle` is the limit of the adaptive plans instead: before each optimizer step
(untimed) a forward without gradients records every micro-batch's routing, and each is then
planned by Algorithm 2 for its real routing rather than for the normal band
(`Provisioner.routing`, `Provisioner.foresee`). The garbage collector is frozen after set-up and
every process collects at the end of each optimizer step (`--no-manual-gc`: Python's own
collector), so no process's collection stalls the others inside a step.

Writes to `--output-dir`: `metrics.jsonl` (per optimizer step: loss, every process's peak device
bytes, the capacity, tokens/s), `bagualu-telemetry.jsonl` (the plugin's events, unless the recipe
names another file or turns telemetry off; `bagualu-telemetry.rank<r>.jsonl` per process when
there are several: `bagualu report OUTPUT_DIR` draws them), `memory.png` (peak per step against
the capacity) and `model/` (`save_pretrained`, with the tokenizer when the checkpoint has one).
`--report-to` hands each step's loss, tokens/s and the plugin's `bagualu/*` figures
(`Provisioner.figures`) to accelerate's trackers (`accelerator.log`; their files in the output
directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from bagualu_plugin import data
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.collector import ManualCollector
from bagualu_plugin.config import TELEMETRY_FILE, RecipeError, read_recipe
from bagualu_plugin.costmodel import Forward
from bagualu_plugin.integrations.accelerate import apply, prepare_model
from bagualu_plugin.parallel import save_expert_parallel
from bagualu_plugin.parallel.launch import end_process
from bagualu_plugin.report import plot_steps
from bagualu_plugin.runtime.ledger import Ledger
from bagualu_plugin.stage import Stage


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a saved HF MoE checkpoint directory")
    parser.add_argument("--recipe", default=None, help="recipe sections overriding the derived ones: a YAML path or a built-in name")
    parser.add_argument("--capacity", default=None, help="device memory the plugin plans for, e.g. 40GiB (default: the GPU's)")
    parser.add_argument("--micro-batches", type=int, default=4, help="gradient-accumulation steps per optimizer step")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--data", help="a text file (one document per line) or a saved datasets directory; default: seeded random tokens")
    policy = parser.add_mutually_exclusive_group()
    policy.add_argument("--no-adaptive", action="store_true", help="the same run without the plugin (memory counted, not limited)")
    policy.add_argument("--oracle", action="store_true", help="plan each micro-batch for its routing, recorded by an untimed first pass")
    parser.add_argument("--report-to", nargs="*", default=[], metavar="TRACKER", help="accelerate's trackers: tensorboard, wandb, ...")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-manual-gc", dest="manual_gc", action="store_false",
        help="leave Python's garbage collector automatic (default: frozen after set-up, collecting after each step)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=600.0, help="process group timeout: a stuck collective fails after this many seconds"
    )
    args = parser.parse_args(argv)
    for flag in ("steps", "micro_batches", "batch_size", "seq_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; expected a directory written by save_pretrained")
    return args


@record  # under `accelerate launch`: a rank's error, with its traceback, in the launcher's summary of the failed job
def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    policy = "no plugin" if args.no_adaptive else "oracle" if args.oracle else "adaptive"
    try:
        given = read_recipe(args.recipe)[1] if args.recipe else {}
    except RecipeError as exc:
        sys.exit(f"--recipe: {exc}")
    m = given.get("pipeline", {}).get("micro_batches", args.micro_batches)
    batch = {"seq_len": args.seq_len, "micro_batch_size": args.batch_size, **given.get("batch", {})}
    seq, mbs = batch["seq_len"], batch["micro_batch_size"]
    out = args.output_dir
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=m,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout_s))],
        log_with=args.report_to or None,
        project_dir=out,
    )
    rank, n, main_process = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    out.mkdir(parents=True, exist_ok=True)
    if args.report_to:
        accelerator.init_trackers("finetune_moe", config={"policy": policy, "steps": args.steps, "micro_batches": m})
    telemetry = {"path": str(out / TELEMETRY_FILE), **given.get("telemetry", {})}  # the run's events with its outputs
    given = {**given, "batch": batch, "telemetry": telemetry}
    if args.capacity:
        capacity = int(args.capacity) if args.capacity.isdigit() else args.capacity
        given["hardware"] = {**given.get("hardware", {}), "capacity_bytes": capacity}

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, experts_implementation="bagualu").train()
    try:
        if args.no_adaptive:
            recipe, prov = prepare_model(model, given, accelerator), None
        else:
            prov = apply(model, given, accelerator)
            recipe = prov.recipe
    except ValueError as exc:
        sys.exit(f"--recipe {args.recipe}: {exc}" if args.recipe else str(exc))
    stage = prov.stage if prov else Stage.of(recipe, model_cost(model, recipe.hardware), split=False)
    ledger = prov.ledger if prov else Ledger.for_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)

    unwrapped = accelerator.unwrap_model(model)
    vocab = unwrapped.config.vocab_size
    try:
        if args.data:
            tokens = data.pack(data.load_texts(args.data), data.load_tokenizer(args.model), seq, vocab)
            batches = data.batches(tokens, args.seed, mbs, m, rank, n)
        else:
            batches = data.synthetic(args.seed, vocab, (mbs, seq), m, rank, n)
    except data.DataError as exc:
        sys.exit(f"--data {args.data}: {exc}" if exc.what != "tokenizer" else f"--model {args.model}: {exc}")

    metrics, steps = (out / "metrics.jsonl").open("w") if main_process else None, []
    try:
        with ManualCollector(args.manual_gc) as collector:
            for step in tqdm(range(args.steps), desc=f"fine-tuning ({policy})", disable=not main_process):
                micro_batches = [ids.to(accelerator.device) for ids in next(batches)]
                if args.oracle:  # every process at once: under expert parallelism the pass dispatches
                    for mb, ids in enumerate(micro_batches):
                        prov.foresee(mb, Forward(ids.numel(), ids.shape[-1], prov.routing(unwrapped, input_ids=ids)))
                ledger.reset_peak()
                start, losses = time.perf_counter(), []
                for ids in micro_batches:
                    with accelerator.accumulate(model), contextlib.nullcontext() if prov else ledger.track():
                        loss = model(input_ids=ids, labels=ids).loss
                        accelerator.backward(loss)
                        losses.append(loss.detach())
                        optimizer.step()
                        optimizer.zero_grad()
                seconds = time.perf_counter() - start
                loss = accelerator.reduce(torch.stack(losses).mean(), "mean").item()
                # the plugin's static bytes are re-based as the optimizer's state appears
                static = prov.stage.static_bytes if prov else stage.static_bytes
                peaks = accelerator.gather(torch.tensor([static + ledger.peak_device_bytes], device=accelerator.device))
                line = {
                    "step": step, "loss": loss, "peak_device_bytes": peaks.tolist(), "capacity_bytes": stage.capacity,
                    "tokens_per_s": n * m * mbs * seq / seconds,
                }
                steps.append(line)
                accelerator.log({"loss": loss, "tokens_per_s": line["tokens_per_s"], **(prov.figures() if prov else {})}, step=step)
                if metrics:
                    metrics.write(json.dumps(line) + "\n")
                    metrics.flush()
                collector.step()
    finally:
        if metrics:
            metrics.close()
        if prov:
            prov.remove()
        for tracker in accelerator.trackers:  # their files complete (`end_training` would also end the process group)
            tracker.finish()

    if recipe.parallel.ep > 1:
        save_expert_parallel(unwrapped, out / "model")
    elif main_process:
        unwrapped.save_pretrained(out / "model")
    if main_process:
        with contextlib.suppress(data.DataError):  # a checkpoint without a tokenizer: the model alone
            data.load_tokenizer(args.model).save_pretrained(out / "model")
        title = f"{Path(args.model).name}: {policy}, {n} process(es), {m} x {mbs} x {seq} tokens"
        plot_steps(steps, out / "memory.png", title)
        last = steps[-1]
        print(f"{args.steps} steps, loss {steps[0]['loss']:.4f} -> {last['loss']:.4f}, peak {max(last['peak_device_bytes'])} "
              f"of {last['capacity_bytes']} bytes; wrote {out}")
    # torch's gloo teardown at the interpreter's exit aborts now and then, with or without the plugin
    # (benchmarks/gloo_exit.py: 3 of 20 plain DDP runs); past a barrier there is nothing left to tear down
    end_process(accelerator.wait_for_everyone)


if __name__ == "__main__":
    main()
