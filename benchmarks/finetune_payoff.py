"""The Accelerate example against its limits: `examples/finetune_moe.py` under `accelerate launch`
(2 processes over gloo) on a tiny Qwen3-MoE and a local text file, with the recipe of
`recipes/accelerate/tiny-qwen3-moe-2cpu.yaml` (a simulated capacity of 0.7x what one micro-batch
keeps unmitigated, so every micro-batch is planned), data parallel and expert parallel (`parallel:
{ep: 2}`), each run three ways:

- adaptive: the plugin as users run it (`bgl.apply`'s plans for the normal routing band, escalated
  at the gates);
- oracle: the plugin with each micro-batch planned by Algorithm 2 for its real routing, recorded by
  an untimed forward before the step (`--oracle`): the best the adaptive plans can be here;
- unbounded: no plugin (`--no-adaptive`): nothing mitigated and no capacity (the activations are
  counted, never limited), the fastest any policy can run; it does not fit the capacity.

The runs of one layout take turns (`--rounds` of each, in the same order every round) so that the
ratios of one invocation compare on a noisy machine. Per run: the losses (the three are the same
training, bit for bit), the worst process's peak against the capacity, the median tokens/s of the
steps after the first (pooled over the rounds) with its p10-p90 spread, and the ratios to the
oracle and to the unbounded run.

    python benchmarks/finetune_payoff.py [--steps 20] [--rounds 2] [--json FILE]   (~10 min on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bagualu_plugin.adapters.tiny import save_tiny, tiny_tokenizer
from bagualu_plugin.parallel.launch import free_port
from bagualu_plugin.report import table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune_moe.py"
RECIPE = ROOT / "recipes" / "accelerate" / "tiny-qwen3-moe-2cpu.yaml"
POLICIES = {"adaptive": [], "oracle": ["--oracle"], "unbounded": ["--no-adaptive"]}
LAYOUTS = {"DDP": {}, "EP": {"parallel": {"ep": 2}}}
WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens across ranks".split()
LAUNCH_TIMEOUT_S = 600


def _launch(work: Path, recipe: Path, steps: int, out: Path, flags: list[str]) -> list[dict]:
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(EXAMPLE), "--model", str(work / "ckpt"),
           "--recipe", str(recipe), "--steps", str(steps), "--output-dir", str(out), "--data", str(work / "corpus.txt"),
           "--timeout-s", "120", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _row(runs: list[list[dict]]) -> dict:
    first = runs[0]
    for run in runs[1:]:
        if [s["loss"] for s in run] != [s["loss"] for s in first]:
            raise RuntimeError("two rounds of one run trained differently")
    rates = sorted(s["tokens_per_s"] for run in runs for s in run[1:])
    deciles = statistics.quantiles(rates, n=10)
    return {
        "losses": [s["loss"] for s in first],
        "peak_device_bytes": max(max(s["peak_device_bytes"]) for run in runs for s in run),
        "capacity_bytes": first[0]["capacity_bytes"],
        "tokens_per_s": statistics.median(rates),
        "p10": deciles[0], "p90": deciles[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (the first is left out of tokens/s)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each policy per layout, taking turns")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be >= 3 (the first step is left out of tokens/s), got {args.steps}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if importlib.util.find_spec("accelerate") is None:
        parser.error("accelerate is not installed (pip install 'bagualu-plugin[accelerate]'): every run here is an accelerate launch")
    results: dict[str, dict] = {}
    headers = ["run", f"loss, step 0 -> {args.steps - 1}", "peak per step, worst process", "vs capacity", "tokens/s (median)",
               "p10-p90", "vs oracle", "vs unbounded"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        save_tiny("qwen3_moe", work / "ckpt", num_hidden_layers=4)
        tiny_tokenizer().save_pretrained(work / "ckpt")
        (work / "corpus.txt").write_text("\n".join(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40)) for i in range(300)))
        for layout, sections in LAYOUTS.items():  # each printed and written as it completes; a failing one fails alone
            try:
                results[layout] = _layout(work, layout, sections, args.steps, args.rounds)
                print(table(headers, _rows(layout, results[layout])), flush=True)
            except Exception as exc:  # noqa: BLE001 - a launch's failure is its layout's
                results[layout] = {"failed": f"{type(exc).__name__}: {str(exc).strip()[:4000]}"}
                print(f"{layout}: failed: {results[layout]['failed']}", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    rows = [row for layout, by_policy in results.items() if "failed" not in by_policy for row in _rows(layout, by_policy)]
    print("\n" + table(headers, rows) + "".join(f"\n{layout}: failed" for layout, r in results.items() if "failed" in r))
    return 1 if any("failed" in r for r in results.values()) else 0


def _layout(work: Path, layout: str, sections: dict, steps: int, rounds: int) -> dict[str, dict]:
    """Every policy of one layout, taking turns round by round; they must train alike."""
    recipe = work / f"{layout}.yaml"
    recipe.write_text(yaml.safe_dump({**yaml.safe_load(RECIPE.read_text()), **sections}))
    runs: dict[str, list] = {policy: [] for policy in POLICIES}
    for r in range(rounds):
        for policy, flags in POLICIES.items():
            print(f"{layout} {policy}, round {r + 1} of {rounds}", file=sys.stderr, flush=True)
            runs[policy].append(_launch(work, recipe, steps, work / f"{layout}-{policy}-{r}", flags))
    by_policy = {policy: _row(rs) for policy, rs in runs.items()}
    if len({tuple(row["losses"]) for row in by_policy.values()}) != 1:
        raise RuntimeError(f"{layout}: the policies trained differently: {by_policy}")
    return by_policy


def _rows(layout: str, by_policy: dict[str, dict]) -> list[list]:
    oracle, unbounded = by_policy["oracle"]["tokens_per_s"], by_policy["unbounded"]["tokens_per_s"]
    rows = []
    for policy, row in by_policy.items():
        losses, peak, capacity = row["losses"], row["peak_device_bytes"], row["capacity_bytes"]
        rows.append([
            f"{layout}, {policy}", f"{losses[0]:.4f} -> {losses[-1]:.4f}", f"{peak:,} B",
            f"{peak / capacity:.2f}x" + (": would not fit" if peak > capacity else ""),
            f"{row['tokens_per_s']:,.0f}", f"{row['p10']:,.0f}-{row['p90']:,.0f}",
            f"{row['tokens_per_s'] / oracle:.2f}x", f"{row['tokens_per_s'] / unbounded:.2f}x",
        ])
    return rows


if __name__ == "__main__":
    sys.exit(main())
