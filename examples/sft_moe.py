"""Fine-tune a saved HF MoE checkpoint with TRL's SFTTrainer (or HF's Trainer) and the plugin's
callback, under `python` or `accelerate launch` (DDP over the processes; `--ep`: the routed experts
sharded over them).

    accelerate launch --multi_gpu --num_processes 2 examples/sft_moe.py \\
        --model CKPT --data corpus.txt --output-dir out [--capacity 40GiB] [--lora] [--ep] [--no-plugin] [--report-to tensorboard] \\
        [--attn-implementation eager] [--deterministic] [--deepspeed ds_config.json]

The recipe is derived (the model's dimensions, the device and its memory, the processes, the
gradient-accumulation steps); on CPU `--capacity` is the simulated device memory the plugin plans
for. `--no-plugin` is the same run without the plugin, its activations counted (not limited) as
`bagualu/unplanned_peak_device_bytes`. Writes `--output-dir`/`log_history.json` (the Trainer's log
records, the plugin's figures in them), the callback's `bagualu-telemetry.jsonl` (one file per
process when there are several: `bagualu report OUTPUT_DIR` draws them), `recipe-rank{R}.json`
(the recipe process R derived: its parallel section, and in `budget` the sharding engine it prices)
and `model/` (`save_pretrained`; under `--ep` the experts gathered whole; under FSDP2 or DeepSpeed,
as `accelerate launch --config_file` enables them (FSDP2 on GPUs only), the Trainer's `save_model`,
which gathers the shards as the engine's config says). `--report-to` names the Trainer's loggers
(`tensorboard`, `wandb`, `mlflow`, ...): the plugin's `bagualu/*` figures reach them too. Under `torchrun` too, on one node or several
(`--nnodes 2 --node_rank 0|1 --rdzv_backend c10d --rdzv_endpoint HOST:PORT`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint and a local dataset: nothing from a hub

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from bagualu_plugin import data  # noqa: E402
from bagualu_plugin.integrations.accelerate import shard_experts_for_ddp  # noqa: E402
from bagualu_plugin.integrations.transformers import BagualuCallback, UnplannedCallback  # noqa: E402
from bagualu_plugin.parallel import save_expert_parallel  # noqa: E402
from bagualu_plugin.parallel.launch import end_process  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a saved HF MoE checkpoint directory (with its tokenizer)")
    parser.add_argument("--data", required=True, help="a text file (one document per line) or a saved datasets directory")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--capacity", default=None, help="device memory the plugin plans for, e.g. 40GiB (default: the GPU's)")
    parser.add_argument("--trainer", choices=("sft", "hf"), default="sft", help="TRL's SFTTrainer (default) or HF's Trainer")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=4, help="gradient-accumulation steps (micro-batches per step)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--max-length", type=int, default=48, help="tokens per sequence at most")
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA on the attention projections")
    parser.add_argument("--ep", action="store_true", help="expert parallelism over all processes")
    parser.add_argument("--deepspeed", default=None, metavar="JSON",
                        help="DeepSpeed's config, through the Trainer's own deepspeed argument (as `accelerate launch --config_file` does)")
    parser.add_argument("--no-plugin", action="store_true", help="the same run without the callback")
    parser.add_argument("--strategies", default="recompute,offload", help="what the plugin may do (fp8 too: not bitwise)")
    parser.add_argument("--report-to", nargs="*", default=[], metavar="LOGGER", help="the Trainer's report_to (default: none)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn-implementation", default=None, help="transformers' attention kernel (eager, sdpa, ...; default: its own)")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels (CUDA's atomic adds differ run to run): to compare with --no-plugin bitwise")
    args = parser.parse_args(argv)
    for flag in ("steps", "accumulation", "batch_size", "max_length"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    cpu = not torch.cuda.is_available()
    if args.deterministic:  # warn_only: an op with no deterministic kernel says so and runs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)
    implementation = {"experts_implementation": "bagualu"} if args.ep else {}  # expert parallelism dispatches through it
    if args.attn_implementation:
        implementation["attn_implementation"] = args.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, **implementation)
    common = dict(
        output_dir=str(args.output_dir), per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps, learning_rate=args.lr, logging_steps=1, report_to=args.report_to, save_strategy="no", seed=args.seed,
        use_cpu=cpu, gradient_checkpointing=False,  # the plugin owns recompute; TRL turns this on by default
        ddp_find_unused_parameters=False, deepspeed=args.deepspeed,
        # the checkpoint's own precision, under every engine this script launches (DeepSpeed's and FSDP's
        # own mixed precision are recipes of their own); TRL's default, bf16 autocast over FP32 weights, is
        # planned exactly too
        bf16=model.dtype == torch.bfloat16,
    )
    training = SFTConfig(max_length=args.max_length, **common) if args.trainer == "sft" else TrainingArguments(**common)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    if tokenizer.pad_token is None:  # HF's language-modelling collator pads with one (TRL picks one itself)
        tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_dict({"text": list(data.load_texts(args.data))})

    recipe = {"strategies": {"allowed": args.strategies.split(",")}}
    if args.capacity:
        recipe["hardware"] = {"capacity_bytes": int(args.capacity) if args.capacity.isdigit() else args.capacity}
    if args.ep:
        recipe["parallel"] = {"ep": training.world_size}
    callback = UnplannedCallback() if args.no_plugin else BagualuCallback(recipe)
    peft = None
    if args.lora:
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    if args.trainer == "sft":
        trainer = SFTTrainer(model=model, args=training, train_dataset=dataset, processing_class=tokenizer, peft_config=peft,
                             callbacks=[callback])
    else:
        if peft is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft)
        tokenized = dataset.map(lambda row: tokenizer(row["text"], truncation=True, max_length=args.max_length), remove_columns=["text"])
        trainer = Trainer(model=model, args=training, train_dataset=tokenized, processing_class=tokenizer,
                          data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), callbacks=[callback])
    if args.ep and args.no_plugin:  # the plugin's callback shards them itself
        shard_experts_for_ddp(trainer.model)
    trainer.train()

    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:  # every process takes part in the gather
        trainer.save_model(str(out / "model"))
    else:
        model = trainer.model.merge_and_unload() if args.lora else trainer.model
        if args.ep:
            save_expert_parallel(model, out / "model")
        elif trainer.is_world_process_zero():
            model.save_pretrained(out / "model")
    if not args.no_plugin:  # what each process derived: its data- and expert-parallel rank among all, its engine's bytes
        recipe = callback.provisioner.recipe.model_dump(mode="json", include={"parallel", "budget"})
        (out / f"recipe-rank{training.process_index}.json").write_text(json.dumps(recipe))
    if trainer.is_world_process_zero():
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        if not args.no_plugin:
            last = trainer.state.log_history[-2]  # the last step's record (the final one is the run's summary)
            print(f"peak {last['bagualu/peak_device_bytes']} of {last['bagualu/capacity_bytes']} bytes, "
                  f"{callback.provisioner.forwards} micro-batches planned; wrote {out}")
    # torch's gloo teardown at the interpreter's exit aborts now and then, with or without the plugin
    # (benchmarks/gloo_exit.py: 3 of 20 plain DDP runs); past a barrier there is nothing left to tear down
    end_process(trainer.accelerator.wait_for_everyone)


if __name__ == "__main__":
    main()
