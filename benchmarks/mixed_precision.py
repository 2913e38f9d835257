"""Standard mixed precision, exactly: FP32 weights under autocast to BF16 (TRL's SFTConfig defaults
on a checkpoint saved in FP32, HF's Trainer with bf16=True) or to FP16, on every family at 0.5x and
0.7x the capacity one unmitigated micro-batch needs, recompute and offload allowed. Each case
trains two optimizer steps on texts of 2 to 60 words (many truncated, every batch padded to its
longest) with and without the plugin: it must keep what its cost model predicts in every
micro-batch (no miss), move nothing to host memory (no spill), stay under the capacity, and end
with bitwise the weights of the run without the plugin.

FP16 runs as a loop's `torch.autocast(dtype=torch.float16)`: accelerate runs no FP16 autocast on a
CPU, so HF's Trainer with fp16=True trains in FP32 there (on a GPU it is the same autocast).

    python benchmarks/mixed_precision.py             # 48 cases, two runs each: about a minute on 2 cores
    python benchmarks/mixed_precision.py --families qwen3_moe --fractions 0.5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from exactness_sweep import FAMILIES, Case, run

# variant: (trainer, LoRA, precision)
VARIANTS = {
    "SFTTrainer, SFTConfig defaults": ("sft", False, "mixed-bf16"),
    "SFTTrainer, LoRA": ("sft", True, "mixed-bf16"),
    "Trainer, bf16=True": ("hf", False, "mixed-bf16"),
    "loop, fp16 autocast": ("loop", False, "mixed-fp16"),
}
SHAPES = ((2, 24, 3), (3, 40, 1), (4, 16, 2), (2, 32, 2))  # batch, max_length, accumulation: one per case, in turn


def grid(families: tuple[str, ...] = FAMILIES, fractions: tuple[float, ...] = (0.5, 0.7)) -> list[tuple[str, Case]]:
    """(variant, case) for every variant, family and capacity fraction; the shapes rotate."""
    cases = []
    for variant, (trainer, lora, precision) in VARIANTS.items():
        for family in families:
            for fraction in fractions:
                batch, length, accumulation = SHAPES[len(cases) % len(SHAPES)]
                case = Case(family, trainer, lora, batch, length, accumulation, ("recompute", "offload"), 0.0, len(cases), precision)
                cases.append((variant, replace(case, fraction=fraction)))
    return cases


def check(case: Case, root: Path) -> list:
    """One case with and without the plugin: the table's row, its last cell the verdict."""
    got, plain = run(case, root), run(case, root, plugin=False)
    bitwise = got.digest == plain.digest != ""
    verdict = "exact" if got.result == "fits" and bitwise else got.result if got.result != "fits" else "not bitwise"
    misses = got.detail if got.result == "misses" else "0"
    spilled = got.detail if got.result == "spilled" else "0"
    return [case.family, f"{case.fraction}x", f"{case.batch}x{case.length}x{case.accumulation}", got.micro_batches, got.mitigated,
            misses, spilled, "yes" if bitwise else "no", verdict]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.7])
    args = parser.parse_args(argv)
    import logging
    import warnings

    from tqdm import tqdm

    from bagualu_plugin.report import table

    logging.disable(logging.WARNING)
    cases = grid(tuple(args.families), tuple(args.fractions))
    rows = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for variant, case in tqdm(cases, desc="cases"):
            try:
                rows.append([variant, *check(case, Path(tmp))])
            except Exception as error:  # noqa: BLE001 - a case's crash is its verdict
                rows.append([variant, case.family, f"{case.fraction}x", "", "", "", "", "", "", f"error: {error}"[:120]])
    print(table(["variant", "family", "capacity", "batch x length x accumulation", "micro-batches", "planned", "misses", "spilled",
                 "bitwise", "verdict"], rows))
    failed = [row for row in rows if row[-1] != "exact"]
    print(f"{len(rows)} cases: {len(rows) - len(failed)} exact, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
