"""How well the cost model predicts what a real model saves for backward (paper §IV, §VI-D).

For every supported family (tiny random-init models, CPU), dtype and attention kernel:

1. shard the model over 2 expert-parallel gloo processes (`bgl.expert_parallel`) and profile
   it on both at once (`bgl.profile`) at 64, 128 and 256 tokens with routing skews 0 and 0.5
   (towards rank 0, so both ranks' local pairs vary);
2. run micro-batches it never saw (shapes 3x100, 1x96, 4x50, 2x72 at skews 0.25 and 0.75),
   measure each rank's saved bytes with the Ledger and the forward+backward wall time, and
   compare with that rank's prediction for the same tokens, sequence length and local routed
   pairs it received (8 cases per rank, 16 per row);
3. compare the analytic model (`CostModel.from_config` on the model's config) with a profile
   of the whole model in one process, at the same shapes.

Memory is exact arithmetic on CPU, so its error should be ~0; time is wall clock on a noisy
2-core machine and is reported without a bar. The paper reports 1.56% mean memory error.

    python benchmarks/costmodel_accuracy.py [--families glm4_moe,qwen3_moe] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from tqdm import tqdm

from bagualu_plugin import expert_parallel
from bagualu_plugin.adapters import FAMILIES, tiny_model
from bagualu_plugin.costmodel import CostModel, Forward, ModelDims
from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.report import table
from bagualu_plugin.runtime.profiler import measure_micro_batch, profile

PROFILE_TOKENS = [64, 128, 256]
SHAPES = [(3, 100), (1, 96), (4, 50), (2, 72)]
SKEWS = [0.25, 0.75]
EP = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model(family: str, dtype: str, attention: str):
    model = tiny_model(family, dtype=DTYPES[dtype])
    try:
        model.set_attn_implementation(attention)
    except ValueError:
        return None  # gpt-oss has no sdpa path (attention sinks)
    return model


def case(family: str, dtype: str, attention: str, repeats: int, rank: int) -> dict | None:
    model = _model(family, dtype, attention)
    if model is None:
        return None
    model.set_experts_implementation("bagualu")
    expert_parallel(model)
    generator = torch.Generator().manual_seed(1 + rank)
    cm = profile(model, PROFILE_TOKENS, repeats=repeats)
    memory, timing = [], []
    for batch, seq_len in SHAPES:
        ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=generator)
        for skew in SKEWS:
            saved, routed, seconds = measure_micro_batch(model, ids, skew=skew, repeats=repeats)
            tokens = batch * seq_len
            pairs = [routed[i] for i in cm.moe_layers]
            predicted = cm.activation_bytes(tokens, routed=pairs, seq_len=seq_len)
            mb = cm.micro_batch(Forward(tokens, seq_len, pairs))
            memory.append(abs(predicted - saved) / saved)
            timing.append(abs(mb.forward_s + mb.backward_s - seconds) / seconds)
    row = {"family": family, "dtype": dtype, "attention": attention, "memory": memory, "timing": timing}
    if rank == 0:  # analytic formulas against a profile of the whole model in one process
        whole = _model(family, dtype, attention)
        real = profile(whole, PROFILE_TOKENS, repeats=1)
        analytic = CostModel.from_config(ModelDims.from_hf_config(whole.config, dtype=dtype, attention=attention), "cpu")
        row["agreement"] = [
            abs(analytic.activation_bytes(b * n, seq_len=n) - real.activation_bytes(b * n, seq_len=n))
            / real.activation_bytes(b * n, seq_len=n)
            for b, n in SHAPES
        ]
    return row


def _rank(rank: int, size: int, combos: list, repeats: int) -> list[dict]:
    """Every case on this rank, in the same order as the other rank's (their forwards exchange tokens)."""
    return [r for c in tqdm(combos, desc="families x dtypes x kernels", disable=rank != 0) if (r := case(*c, repeats, rank))]


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for cases in zip(*per_rank):
        memory = [e for c in cases for e in c["memory"]]
        timing = [e for c in cases for e in c["timing"]]
        rows.append({
            "family": cases[0]["family"],
            "dtype": cases[0]["dtype"],
            "attention": cases[0]["attention"],
            "cases": len(memory),
            "memory_mean_error": statistics.mean(memory),
            "memory_max_error": max(memory),
            "time_mean_error": statistics.mean(timing),
            "analytic_max_disagreement": max(cases[0]["agreement"]),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    combos = [(f, d, a) for f in args.families.split(",") for d in DTYPES for a in ("sdpa", "eager")]
    rows = _merge(run_ranks(_rank, EP, combos, args.repeats, timeout_s=600))
    print(
        table(
            ["family", "dtype", "attention", "cases", "memory mean err", "memory max err", "time mean err", "analytic vs profiled"],
            [
                [
                    r["family"], r["dtype"], r["attention"], r["cases"],
                    f"{r['memory_mean_error']:.3%}", f"{r['memory_max_error']:.3%}",
                    f"{r['time_mean_error']:.1%}", f"{r['analytic_max_disagreement']:.3%}",
                ]
                for r in rows
            ],
        )
    )
    mean = statistics.mean(r["memory_mean_error"] for r in rows)
    worst = max(r["memory_max_error"] for r in rows)
    agree = max(r["analytic_max_disagreement"] for r in rows)
    print(f"\nall: memory mean error {mean:.3%}, max {worst:.3%}; analytic vs profiled within {agree:.3%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
