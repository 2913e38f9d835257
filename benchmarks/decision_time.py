"""How long BaGuaLu-2's decisions take on the stream of shapes users bring (paper §V-A, §VI-D: the
planner decides in under 10 ms per iteration).

The planner's time of one micro-batch is its budget and plan (`Decider.begin`, what
`Provisioner.begin_forward` calls) and every MoE gate's decision in its forward (`Decider.at_gate`):
per micro-batch, the median, the 99th percentile, the largest after the run's first, and the run's
first, whose paths start cold.

1. Real checkpoints at full depth, built on the meta device from their published config.json
   (Qwen3-30B-A3B, DeepSeek-V3, GLM-4.5, Mixtral-8x22B: their layers, experts and top-k; no weights),
   their recipe derived as `bgl.derive_recipe` derives it for TRL (the batch at `max_length`), on the
   pipeline stage that holds the most micro-batches in flight (stage 0) of a layout like the paper's
   Table II presets (expert parallelism, pipeline stages; DeepSeek-V3's 61 layers admit no even
   stages: one stage holds them all), and the other three with all their layers on one stage too
   (48, 92 and 56 layers; the last two on H200s, sharded further to fit). The stream is TRL's default collator's: each micro-batch B
   texts padded to the longest, the texts' lengths drawn from a log-normal distribution (median 512
   tokens, about one in nine past 2K), truncated at `max_length`; gradient accumulation over the
   recipe's micro-batches; the gates' routing in the normal band (0.9x to 1.2x of balanced) and, in
   2.9% of micro-batches, a spike up to 2.6x (§II-B). What each forward keeps is priced by the cost
   model, as the simulator does.
2. TRL's SFTTrainer end to end on deep narrow tiny models (Qwen3-MoE of 24 and 48 layers of hidden
   64, FP32 as saved: `bf16=False`), its default collator padding each micro-batch of 4 texts to
   the longest (character lengths log-normal, median 200, truncated at 512 tokens), 2 micro-batches
   per step: the same run without the plugin (its peak measured by `UnplannedCallback`), with it
   at ample capacity (nothing to plan) and at half the activations that peak holds (most
   micro-batches planned). Tokens/s (the padded tokens), the plugin's against the plain run's, and
   the planner's share of each optimizer step (`Event.planner_s` of its micro-batches:
   `begin_forward`'s budget, plan and install, and every gate's decision, over the step's wall
   time): the median step, the largest after the first, the first (where the paths start cold),
   and the whole run. The garbage collector is frozen after set-up in all three.
3. The simulator's Table II presets from a cold start (`bagualu simulate`): per chunk forward, and
   per iteration (the slowest pipeline rank, fused-point schedules included).

    python benchmarks/decision_time.py [--micro-batches 2000] [--steps 30] [--iterations 100]   (about 8 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, MixtralConfig, Qwen3MoeConfig, TrainerCallback

import bagualu_plugin as bgl
from bagualu_plugin import load_recipe
from bagualu_plugin.collector import ManualCollector, frozen
from bagualu_plugin.costmodel import Forward
from bagualu_plugin.planner.decider import Decider
from bagualu_plugin.report import table
from bagualu_plugin.sim.run import simulate
from bagualu_plugin.stage import Stage

SPIKE_RATE, SPIKE_MAX, NORMAL = 0.029, 2.6, (0.9, 1.2)  # §II-B: 2.9% of iterations spike, up to 2.6x
TEXT_MEDIAN, TEXT_SIGMA = 512, 1.0  # tokens per text: log-normal
EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")  # what each config.json calls its routed experts
SFT_MEDIAN, SFT_MAX_LENGTH, SFT_BATCH, SFT_ACCUMULATION = 200, 512, 4, 2  # part 2: characters per text (log-normal), TRL's batching


@dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint's config.json (the fields that size it), the layout it trains on
    (hardware preset, parallel, pipeline, accumulation) and how TRL batches it (texts per micro-batch,
    `max_length`)."""

    name: str
    config: object
    hardware: str
    parallel: dict
    pp: int
    batch: int
    max_length: int
    accumulation: int = 16


CHECKPOINTS = (
    Checkpoint(
        "Qwen3-30B-A3B",
        Qwen3MoeConfig(
            hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=True,
            max_position_embeddings=40960,
        ),
        "h100", {"dp": 8, "tp": 1, "ep": 8}, pp=4, batch=4, max_length=4096,
    ),
    Checkpoint(
        "DeepSeek-V3",
        DeepseekV3Config(
            hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
            n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3,
            intermediate_size=18432, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=163840,
        ),
        "h200", {"dp": 64, "tp": 8, "ep": 64}, pp=1, batch=2, max_length=8192,
    ),
    Checkpoint(
        "GLM-4.5",
        Glm4MoeConfig(
            hidden_size=5120, num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
            n_routed_experts=160, num_experts_per_tok=8, moe_intermediate_size=1536, n_shared_experts=1, first_k_dense_replace=3,
            intermediate_size=12288, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, norm_topk_prob=True,
            routed_scaling_factor=2.5, n_group=1, topk_group=1, max_position_embeddings=131072,
        ),
        "h200", {"dp": 16, "tp": 2, "ep": 32}, pp=4, batch=1, max_length=8192,
    ),
    Checkpoint(
        "Mixtral-8x22B",
        MixtralConfig(
            hidden_size=6144, num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8, head_dim=128, vocab_size=32768,
            num_local_experts=8, num_experts_per_tok=2, intermediate_size=16384, max_position_embeddings=65536,
        ),
        "h100", {"dp": 8, "tp": 2, "ep": 8}, pp=4, batch=8, max_length=2048,
    ),
)


# The same checkpoints at their full depth on one pipeline stage, laid out to fit there (GLM-4.5's 92
# layers and Mixtral's 56 on H200s, sharded further); DeepSeek-V3 above is one stage already.
FULL_DEPTH = (
    replace(CHECKPOINTS[0], pp=1, batch=2),
    replace(CHECKPOINTS[2], hardware="h200", parallel={"dp": 32, "tp": 8, "ep": 32}, pp=1),
    replace(CHECKPOINTS[3], hardware="h200", parallel={"dp": 8, "tp": 8, "ep": 8}, pp=1),
)


def stage_of(checkpoint: Checkpoint, pp: int | None = None) -> Stage:
    """Stage 0 of `checkpoint`'s layout (`pp` stages where given), its recipe derived from the model on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=torch.bfloat16)
    recipe = bgl.derive_recipe(model, {
        "hardware": checkpoint.hardware,
        "parallel": checkpoint.parallel,
        "pipeline": {"pp": pp or checkpoint.pp, "rank": 0, "micro_batches": checkpoint.accumulation},
        "batch": {"seq_len": checkpoint.max_length, "micro_batch_size": checkpoint.batch},
    })
    return Stage.of(recipe)


def padded_lengths(rng: random.Random, texts: int, max_length: int) -> int:
    """The padded length of one micro-batch of `texts` texts, as TRL's collator pads: the longest, truncated."""
    return max(min(max_length, max(16, round(rng.lognormvariate(math.log(TEXT_MEDIAN), TEXT_SIGMA)))) for _ in range(texts))


def stream(stage: Stage, forwards: int, seed: int = 0) -> dict:
    """The planner's seconds per micro-batch over `forwards` micro-batches of the TRL-like stream
    (`seconds`), and of them its gates' (`gates`, with the micro-batches whose gates escalated)."""
    rng = random.Random(seed)
    recipe, cm = stage.recipe, stage.cost
    texts, max_length, m = recipe.batch.micro_batch_size, recipe.batch.seq_len, recipe.pipeline.micro_batches
    decider = Decider(stage)
    seconds, gates, planned, escalated, shapes = [], [], 0, 0, set()
    with ManualCollector() as collector:  # as the launchers train: collections at iteration boundaries, untimed
        for k in range(forwards):
            if k % m == 0:
                collector.step()
                decider.start_iteration()
            length = padded_lengths(rng, texts, max_length)
            tokens = texts * length
            spike = rng.random() < SPIKE_RATE
            imbalance = [rng.uniform(1.2, SPIKE_MAX) if spike else rng.uniform(*NORMAL) for _ in cm.moe_layers]
            start = time.perf_counter()
            f = decider.begin(k % m, tokens, length)
            begun = time.perf_counter()
            for layer, x in zip(cm.moe_layers, imbalance):
                decider.at_gate(f, layer, f.balanced * x)
            end = time.perf_counter()
            seconds.append(end - start)
            gates.append(end - begun)
            kept = cm.footprint(Forward(tokens, length, [f.balanced * x for x in imbalance]), f.plan, stage.options)
            decider.end(f, round(kept.device_bytes + kept.room_bytes))
            planned += bool(f.gates.decision.plan)
            escalated += bool(f.escalations)
            shapes.add(tokens)
    return {"seconds": seconds, "gates": gates, "planned": planned / forwards, "escalated": escalated, "shapes": len(shapes),
            "paths": decider.planner(None).paths}


class StepClock(TrainerCallback):
    """Each optimizer step's wall-clock seconds, from its first micro-batch to the optimizer's end."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def sft_runs(layers: int, steps: int) -> list[list[str]]:
    """Part 2's three runs on a tiny Qwen3-MoE of `layers` layers: a row for each run with the plugin."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from bagualu_plugin.adapters import tiny_model
    from bagualu_plugin.adapters.tiny import tiny_tokenizer
    from bagualu_plugin.integrations.transformers import BagualuCallback, UnplannedCallback

    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(max(8, round(rng.lognormvariate(math.log(SFT_MEDIAN), 0.8)))))
             for _ in range(SFT_BATCH * SFT_ACCUMULATION * steps)]
    dataset, tokenizer = Dataset.from_dict({"text": texts}), tiny_tokenizer()

    def train(callback, steps: int = steps) -> tuple[float, list[float]]:
        torch.manual_seed(0)
        model = tiny_model("qwen3_moe", num_hidden_layers=layers)
        args = SFTConfig(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=SFT_BATCH, gradient_accumulation_steps=SFT_ACCUMULATION,
            max_steps=steps, max_length=SFT_MAX_LENGTH, report_to=[], save_strategy="no", logging_strategy="no", seed=0, use_cpu=True,
            bf16=False, gradient_checkpointing=False, disable_tqdm=True, dataloader_num_workers=0,
        )
        clock = StepClock()
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[callback, clock])
        with frozen():
            return trainer.train().metrics["train_runtime"], clock.seconds

    train(UnplannedCallback(), 3)  # the process's first steps (allocations, lazy set-up) timed in none of the runs
    unplanned = UnplannedCallback()
    plain, _ = train(unplanned)
    peak, static = max(unplanned.peaks), max(unplanned.static_bytes)
    rows = []
    for name, capacity in (("ample", 100 * peak), ("half the activations", static + (peak - static) // 2)):
        callback = BagualuCallback({"hardware": {"capacity_bytes": capacity}})
        runtime, step_s = train(callback)
        events = sorted(callback.provisioner.events, key=lambda e: e.forward)
        tokens = sum(e.tokens for e in events)
        planner = [0.0] * len(step_s)
        for e in events:
            planner[e.forward // SFT_ACCUMULATION] += e.planner_s
        shares = [p / s for p, s in zip(planner, step_s)]
        planned = sum(bool(e.plan) for e in events) / len(events)
        rows.append([
            f"{layers} layers, {name}", f"{len({e.tokens for e in events})}", f"{100 * planned:.0f}%",
            f"{tokens / runtime:,.0f}", f"{tokens / plain:,.0f}", f"{plain / runtime:.3f}x",
            f"{1e3 * statistics.median(e.planner_s for e in events):.2f}", f"{100 * statistics.median(shares):.2f}%",
            f"{100 * max(shares[1:]):.2f}%", f"{100 * shares[0]:.2f}%", f"{100 * sum(planner) / sum(step_s):.2f}%",
            str(sum(len(e.misses) for e in events)), str(sum(e.spilled_bytes for e in events)),
        ])
    return rows


def _ms(x: float) -> str:
    return f"{1e3 * x:.2f}"


def _stats(seconds: list[float]) -> list[str]:
    after = sorted(seconds[1:])
    p99 = after[min(len(after) - 1, math.ceil(0.99 * len(after)) - 1)]
    slow = sum(s > 0.05 for s in after)
    return [_ms(statistics.median(seconds)), _ms(p99), _ms(after[-1]), str(slow), _ms(seconds[0])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=2000, help="micro-batches of each checkpoint's stream (default 2000)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each SFTTrainer run (default 30)")
    parser.add_argument("--iterations", type=int, default=100, help="simulated iterations per preset (default 100)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for checkpoint in (*CHECKPOINTS, *FULL_DEPTH):
        stage = stage_of(checkpoint)
        cm = stage.cost
        layers = sum(b.kind in ("dense", "moe") for b in cm.blocks.values())
        experts = next(getattr(checkpoint.config, a) for a in EXPERTS if hasattr(checkpoint.config, a))
        run = stream(stage, args.micro_batches)
        where = f"{checkpoint.name}, stage 0 of {checkpoint.pp} ({layers} layers, {experts} experts, EP {stage.recipe.parallel.ep})"
        shape = f"{checkpoint.batch} x <= {checkpoint.max_length}"
        rows.append([
            where, shape, str(run["shapes"]), f"{100 * run['planned']:.0f}%", str(run["paths"]), *_stats(run["seconds"]),
            _ms(statistics.median(run["gates"])), _ms(max(run["gates"][1:])), str(run["escalated"]),
        ])
    print(f"the planner's time per micro-batch (ms): budget, plan and every gate's decision; {args.micro_batches} micro-batches "
          "of TRL-padded lengths, routing spikes in 2.9%; of it the gates' (median, max after the first), and the micro-batches "
          "whose gates escalated")
    print(table(["checkpoint, stage", "texts x length", "shapes", "planned", "paths", "median", "p99", "max after first",
                 "over 50 ms", "first", "gates median", "gates max", "escalated"], rows))

    torch.set_num_threads(2)
    rows = [row for layers in (24, 48) for row in sft_runs(layers, args.steps)]
    print(f"\nTRL's SFTTrainer on a deep narrow Qwen3-MoE (hidden 64), default collator, {args.steps} steps of {SFT_ACCUMULATION} x "
          f"{SFT_BATCH} texts (at most {SFT_MAX_LENGTH} tokens), FP32: tokens/s against the same run without the plugin, and the "
          "planner's share of each step")
    print(table(["run", "shapes", "planned", "tokens/s", "plain tokens/s", "vs plain", "planner ms/mb", "share: median step",
                 "max step after first", "first step", "whole run", "misses", "spilled"], rows))
    torch.set_num_threads(1)

    sims = []
    for preset in ("glm-423b-a30b", "glm-1041b-a35b-12288"):
        result = simulate(load_recipe(preset), args.iterations, preset=preset)
        sims.append([
            preset, *_stats(result.decision_forward_s),
            f"{1e3 * result.decision_median_s:.2f}", f"{1e3 * result.decision_warm_max_s:.2f}", f"{1e3 * result.decision_first_s:.2f}",
        ])
    print(f"\nthe simulator from a cold start ({args.iterations} iterations): per chunk forward of the slowest rank (ms), and "
          "per iteration (ms; paper: < 10 ms)")
    print(table(["preset", "forward median", "p99", "max after first", "over 50 ms", "first", "iteration median",
                 "warm max", "first (cold)"], sims))


if __name__ == "__main__":
    main()
