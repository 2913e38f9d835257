"""The `bagualu` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from .config import RecipeError, load_recipe
from .costmodel import MITIGATIONS, Curve, MicroBatchCost
from .families import FAMILIES
from .hardware import PRESETS
from .report import plot_curves, plot_timeline, table
from .stage import Stage
from .units import fmt_bytes, fmt_seconds


def _spike(text: str) -> tuple[int, float]:
    mb, sep, factor = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(mb), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--spike expects MICRO_BATCH:IMBALANCE, e.g. 7:2.6; got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagualu", description="Adaptive activation-memory provisioning for MoE training.")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("validate-recipe", help="check recipe files and nanotron configs; every problem names its field")
    v.add_argument("recipes", nargs="+", metavar="RECIPE", help="a recipe or nanotron config (YAML) or a built-in recipe name")

    c = sub.add_parser("curve", help="per-op cost table and the iteration memory curve of a pipeline stage (paper §IV)")
    c.add_argument("recipe", metavar="RECIPE", help="a YAML file or a built-in recipe name, e.g. glm-423b-a30b")
    c.add_argument("--png", default="curve.png", help="where to write the memory curve (default: curve.png)")
    c.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    c.add_argument(
        "--spike",
        type=_spike,
        action="append",
        default=[],
        metavar="MB:IMBALANCE",
        help="also draw the curve with micro-batch MB routing IMBALANCE x the balanced pairs to this device (repeatable)",
    )
    d = sub.add_parser("demo", help="adaptive provisioning against static policies on a tiny MoE with routing spikes (§VI-C)")
    d.add_argument("recipe", nargs="?", default="demo", metavar="RECIPE", help="a demo recipe (default: the built-in demo)")
    d.add_argument("--steps", type=_positive("--steps"), default=20, help="training iterations per policy (default 20)")
    d.add_argument(
        "--policies", type=_policies, default=None, metavar="P,P,...",
        help="a subset of adaptive,none,full_recompute,static_average,static_worst"
    )
    d.add_argument("--png", default="demo-timeline.png", help="where to write the memory timeline (default: demo-timeline.png)")
    d.add_argument("--json", default=None, metavar="FILE", help="also write the numbers of every policy as JSON")
    d.add_argument("--seed", type=int, default=0, help="model and batch seed (the spike schedule has the recipe's)")

    pr = sub.add_parser("profile", help="fit the cost model to a saved HF MoE model by running it (paper §IV)")
    pr.add_argument("--model", required=True, metavar="DIR", help="a save_pretrained directory (loaded offline)")
    pr.add_argument("--tokens", required=True, type=_counts, metavar="T,T,...", help="token counts to run, e.g. 128,256,512")
    pr.add_argument("--out", required=True, metavar="FILE", help="where to write the cost model (JSON)")
    pr.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    pr.add_argument("--attention", choices=("sdpa", "eager"), default=None, help="default: the model's own")
    pr.add_argument("--repeats", type=int, default=3, help="timing repeats per run (median)")

    sm = sub.add_parser(
        "simulate", help="simulated cluster run of a Table II preset: BaGuaLu-2 against static baselines on one spike trace (§VI)"
    )
    sm.add_argument("recipe", metavar="PRESET", help="a built-in cluster preset (e.g. glm-423b-a30b) or a recipe file")
    sm.add_argument("--iterations", type=_positive("--iterations"), default=100, help="iterations per system (default 100)")
    sm.add_argument("--seed", type=int, default=None, help="spike trace seed (default: the recipe's spikes.seed)")
    sm.add_argument("--trace", default=None, metavar="JSONL", help="replay recorded routing (telemetry: routed pairs per MoE gate)")
    sm.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")

    rc = sub.add_parser(
        "recipe", help="the recipe derived from a saved HF MoE checkpoint and this machine, as YAML (a starting point to edit)"
    )
    rc.add_argument("model", metavar="MODEL_PATH", help="a save_pretrained directory (its config.json; no weights are loaded)")
    rc.add_argument(
        "--capacity", default=None, metavar="BYTES", help="device memory, e.g. 40GiB (default: the CUDA device's; required on CPU)"
    )
    rc.add_argument("--micro-batches", type=_positive("--micro-batches"), default=1, help="gradient-accumulation steps (default 1)")
    rc.add_argument(
        "--seq-len", type=_positive("--seq-len"), default=None, help="tokens per sequence (default: the model's max_position_embeddings)"
    )
    rc.add_argument("--batch-size", type=_positive("--batch-size"), default=1, help="sequences per micro-batch (default 1)")
    rc.add_argument("--out", default=None, metavar="FILE", help="write the YAML there instead of printing it")

    t = sub.add_parser("tiny-checkpoint", help="write a tiny random-init MoE checkpoint and a character-level tokenizer (offline)")
    t.add_argument("family", choices=sorted(FAMILIES), metavar="FAMILY", help=f"one of {', '.join(sorted(FAMILIES))}")
    t.add_argument("directory", metavar="DIR", help="where to save_pretrained the model and the tokenizer")
    t.add_argument("--layers", type=_positive("--layers"), default=None, help="decoder layers (default: the family's tiny default)")
    t.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    return p


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {text!r}")
        return value

    return parse


def _policies(text: str) -> list[str]:
    from .demo import POLICIES

    chosen = text.split(",")
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown or len(set(chosen)) != len(chosen):
        raise argparse.ArgumentTypeError(f"--policies expects distinct names from {','.join(POLICIES)}; got {text!r}")
    return chosen


def _counts(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens expects comma-separated integers, e.g. 128,256,512; got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "validate-recipe":
            return _validate(args.recipes)
        if args.command == "profile":
            return _profile(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "tiny-checkpoint":
            return _tiny_checkpoint(args)
        if args.command == "recipe":
            return _recipe(args)
        if args.command == "simulate":
            return _simulate(args)
        return _curve(args)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return 2


def _simulate(args: argparse.Namespace) -> int:
    from .sim import read_trace, simulate

    if args.seed is not None and args.seed < 0:
        raise SystemExit(f"bagualu simulate: --seed must be >= 0, got {args.seed}")
    if args.trace and args.seed is not None:
        raise SystemExit("bagualu simulate: --seed draws a spike trace, --trace replays one: give one of them")
    recipe = load_recipe(args.recipe)
    try:
        trace = read_trace(args.trace, recipe, args.iterations) if args.trace else None
        result = simulate(recipe, args.iterations, args.seed, preset=args.recipe, trace=trace)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"bagualu simulate: {exc}") from None
    rows = [
        [o.system, f"{100 * o.mfu:.1f}%", f"{o.tokens_per_s:,.0f}", o.ooms, f"{o.speedup_vs_best_baseline:.3f}x", f"{o.iteration_s:.2f} s"]
        for o in result.outcomes
    ]
    routing = f"routing recorded in {args.trace}" if args.trace else f"spike seed {result.seed}"
    print(f"SIMULATED: {args.recipe}, {recipe.gpus} devices of {recipe.hardware.name}, {args.iterations} iterations, "
          f"{routing} (cost model times, not measurements)")
    print(table(["system", "MFU", "tokens/s", "OOMs", "vs best baseline", "iteration"], rows))
    print("\nablation (Fig. 11): L1 every layer recomputed, L2 + static fine-grained plans, L3 + dynamic, L4 + fused dual-batch")
    print(table(["level", "tokens/s", "OOMs", "vs previous"],
                [[a.level, f"{a.tokens_per_s:,.0f}", a.ooms, f"{a.speedup_vs_previous:.3f}x"] for a in result.ablation]))
    print(f"BaGuaLu's decisions per iteration (slowest rank): mean {1e3 * result.decision_s:.2f} ms, "
          f"median {1e3 * result.decision_median_s:.2f} ms, max {1e3 * result.decision_max_s:.2f} ms (paper: < 10 ms)")
    if args.json:
        result.save(args.json)
        print(f"wrote {args.json}")
    return 0


def _validate(paths: Sequence[str]) -> int:
    failed = 0
    for path in paths:
        try:
            if _is_nanotron(path):
                print(f"ok: {path} ({_validate_nanotron(path)})")
                continue
            r = load_recipe(path)
            stage = Stage.of(r)
            try:  # Algorithm 1 can start: capacity holds the static bytes and M0 per micro-batch in flight
                stage.budgets()
            except ValueError as exc:
                raise RecipeError(path, [("hardware.capacity_bytes", str(exc))]) from None
        except RecipeError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        memory = (
            f"static {fmt_bytes(stage.static_bytes)} + {stage.warmup} in flight x M0 {fmt_bytes(stage.min_budget)} "
            f"of capacity {fmt_bytes(stage.capacity)}"
        )
        print(f"ok: {path} ({r.model.family}, {r.gpus} devices of {r.hardware.name}, pp {r.pipeline.pp} rank {r.pipeline.rank}; {memory})")
    return 2 if failed else 0


_NANOTRON_SECTIONS = {"general", "parallelism", "tokenizer"}  # required by nanotron's Config; no recipe section


def _is_nanotron(path: str) -> bool:
    """A YAML file whose top level has a bagualu section or nanotron's own; anything else, unreadable
    files included, goes to `load_recipe` and its errors."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and ("bagualu" in data or bool(_NANOTRON_SECTIONS & data.keys()))


def _validate_nanotron(path: str) -> str:
    """nanotron is imported only here, so that plain recipes validate without it."""
    try:
        from .integrations.nanotron.config import validate
    except ImportError as exc:
        raise RecipeError(path, [("", f"a nanotron config: {exc}")]) from None
    return validate(path)


def _profile(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from .adapters import UnsupportedModelError
    from .runtime.profiler import profile

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, local_files_only=True, dtype=dtype, attn_implementation=args.attention
        )
    except OSError as exc:
        raise SystemExit(f"bagualu profile: --model {args.model}: cannot load a saved model offline ({exc})") from None
    try:
        cm = profile(model.train(), args.tokens, repeats=args.repeats, progress=True)
    except (UnsupportedModelError, ValueError) as exc:
        raise SystemExit(f"bagualu profile: {exc}") from None
    cm.save(args.out)
    top = max(args.tokens)  # as one sequence
    rows = [
        [str(c.op), fmt_seconds(c.forward_s), fmt_seconds(c.backward_s), fmt_bytes(c.saved_bytes)]
        for c in cm.op_costs(top, seq_len=top)
    ]
    print(table(["op", "Δt_f", "Δt_b", "Δm"], rows))
    print(f"\nat T = {top}: {fmt_bytes(cm.activation_bytes(top, seq_len=top))} saved for backward; wrote {args.out}")
    return 0


def _recipe(args: argparse.Namespace) -> int:
    import torch

    from .derive import checkpoint_model, recipe_of

    try:
        model = checkpoint_model(args.model)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bagualu recipe: {args.model}: {exc}") from None
    seq_len = args.seq_len or getattr(model.config, "max_position_embeddings", None)
    if seq_len is None:
        raise SystemExit(f"bagualu recipe: {args.model} has no max_position_embeddings: give --seq-len")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and not args.capacity:
        raise SystemExit(
            "bagualu recipe: no CUDA device here, so no device memory to derive: give --capacity (the simulated capacity, e.g. 8GiB)"
        )
    capacity = int(args.capacity) if args.capacity and args.capacity.isdigit() else args.capacity
    given = {"hardware": {"capacity_bytes": capacity}} if capacity else None
    try:
        recipe = recipe_of(model, given, device=device, processes=1, micro_batches=args.micro_batches,
                           batch={"seq_len": seq_len, "micro_batch_size": args.batch_size})
    except ValueError as exc:
        raise SystemExit(f"bagualu recipe: {args.model}: {exc}") from None
    hardware = recipe.hardware
    base = PRESETS[hardware.name]
    sections = {
        "hardware": {"preset": hardware.name, "capacity_bytes": hardware.capacity_bytes},
        "model": {"family": recipe.model.family, **recipe.model.model_dump(mode="json", exclude_defaults=True)},
        "parallel": recipe.parallel.model_dump(mode="json", exclude_none=True),
        "pipeline": recipe.pipeline.model_dump(mode="json", exclude_defaults=True) | {"micro_batches": recipe.pipeline.micro_batches},
        "batch": recipe.batch.model_dump(mode="json"),
    }
    assert hardware.model_copy(update={"capacity_bytes": base.capacity_bytes}) == base  # a preset with its capacity replaced
    text = (
        f"# derived by `bagualu recipe` from {args.model}: every section is optional in bgl.apply / BagualuCallback,\n"
        "# which derive the same from the live model; strategies, budget, telemetry and spikes take the defaults\n"
        + yaml.safe_dump(sections, sort_keys=False)
    )
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def _tiny_checkpoint(args: argparse.Namespace) -> int:
    from .adapters.tiny import save_tiny, tiny_tokenizer

    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    directory = save_tiny(args.family, args.directory, seed=args.seed, **overrides)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    print(
        f"wrote {directory}: a tiny {args.family} checkpoint ({config['num_hidden_layers']} layers, vocab {config['vocab_size']}, "
        f"seed {args.seed}) and a character-level tokenizer ({len(tokenizer)} tokens)"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .demo import POLICIES, run_demo, summary, summary_table

    recipe = load_recipe(args.recipe)
    policies = args.policies or list(POLICIES)
    par, pipe, spikes = recipe.parallel, recipe.pipeline, recipe.spikes
    print(f"bagualu demo: starting {par.ep} expert-parallel ranks (one process each), profiling and pretraining", file=sys.stderr)
    try:
        # the bar counts the hot rank's policy iterations, reported as they finish
        with tqdm(total=args.steps * len(policies), desc="policy iterations", unit="it") as bar:
            results = run_demo(recipe, args.steps, policies, seed=args.seed, progress=bar.update)
    except ValueError as exc:  # e.g. a capacity that cannot hold M0, found before training
        print(f"bagualu demo: {args.recipe}: {exc}", file=sys.stderr)
        return 2
    rows = summary(results)
    title = (
        f"{args.recipe}: {args.steps} iterations x {pipe.micro_batches} micro-batches of {recipe.batch.tokens} tokens per rank, "
        f"pipeline rank {pipe.rank}/{pipe.pp}, EP rank {par.ep_rank} of {par.ep} processes (its memory; the job's tokens/s), "
        f"spikes in {spikes.spike_probability:.1%} of iterations up to {spikes.spike_max_imbalance}x"
    )
    png = plot_timeline(results, args.png, results[0].capacity_bytes, spikes.normal_max_imbalance, 2 * pipe.micro_batches, title)
    print(title)
    print(summary_table(rows))
    print(f"\nwrote {png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recipe": args.recipe, "steps": args.steps, "policies": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _curve(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    stage = Stage.of(recipe)
    pipe = recipe.pipeline
    imbalance = [1.0] * pipe.micro_batches
    for mb, factor in args.spike:
        if not 0 <= mb < pipe.micro_batches:
            raise SystemExit(f"bagualu curve: --spike micro-batch {mb} must be in [0, {pipe.micro_batches})")
        if factor <= 0:
            raise SystemExit(f"bagualu curve: --spike imbalance must be > 0, got {factor}")
        imbalance[mb] = factor
    curves = [("balanced routing", stage.curve())]
    if args.spike:
        spikes = ", ".join(f"F{mb} x{f:g}" for mb, f in args.spike)
        curves.append((f"routing spike ({spikes})", stage.curve(imbalance)))
    rows = _op_rows(stage)
    schedule = "1F1B" if pipe.vp == 1 else f"interleaved 1F1B, {pipe.vp} chunks per rank"
    title = (
        f"{args.recipe}: stage {pipe.rank}/{pipe.pp} on {recipe.hardware.name}, "
        f"{pipe.micro_batches} micro-batches of {stage.tokens} tokens ({schedule}, nothing mitigated)"
    )
    png = plot_curves(curves, args.png, stage.capacity, stage.static_bytes, title)
    if args.json:
        print(json.dumps(_as_json(stage, rows, curves, imbalance, str(png)), indent=1))
    else:
        print(_as_text(stage, rows, curves, title))
        print(f"\nwrote {png}")
    return 0


def _op_rows(stage: Stage) -> list[dict]:
    """Each op of the first block of every kind in the stage, with what each mitigation does."""
    cm, seen, rows = stage.cost, set(), []
    seq = stage.recipe.batch.seq_len
    for cost in cm.op_costs(stage.tokens, seq_len=seq):
        kind = cm.blocks[cost.op.layer].kind
        if (kind, cost.op.name) in seen:
            continue
        seen.add((kind, cost.op.name))
        unit = cm.recompute_unit(cost.op)
        mit = {
            s: cm.mitigation_cost(unit if s == "recompute" else cost.op, s, stage.tokens, seq_len=seq, options=stage.options)
            for s in MITIGATIONS
            if s != "recompute" or unit
        }
        rows.append({"op": cost.op, "kind": kind, "cost": cost, "mitigation": mit, "unit": unit})
    return rows


def _cell(r: dict, strategy: str) -> str:
    m = r["mitigation"].get(strategy)
    if m is None:
        return "n/a"
    mark = "*" if strategy == "recompute" and len(r["unit"]) > 1 else ""
    return f"{fmt_bytes(m.bytes_saved)} / {fmt_seconds(m.forward_s + m.backward_s)}{mark}"


def _as_text(stage: Stage, rows: list[dict], curves: list[tuple[str, Curve]], title: str) -> str:
    cm, recipe = stage.cost, stage.recipe
    dense, expert = cm.parameter_counts()
    mb = stage.micro_batch()
    out = [
        title,
        f"layers {', '.join(f'{c.layers[0]}-{c.layers[-1]}' for c in stage.chunks)} of {recipe.model.num_layers}"
        + (" + embedding" if cm.blocks[-1].dense_params else "")  # later stages hold only its RoPE tables
        + (" + LM head" if recipe.model.num_layers in cm.blocks else "")
        + f"; parallel dp {recipe.parallel.dp} tp {recipe.parallel.tp} ep {recipe.parallel.ep} pp {recipe.pipeline.pp}",
        f"parameters here: {dense / 1e9:.2f} B dense + {expert / 1e9:.2f} B expert"
        f" -> non-activation {fmt_bytes(stage.static_bytes)} of {fmt_bytes(stage.capacity)}",
        "",
        f"per-operator cost, T = {stage.tokens} tokens, S = {stage.tokens * cm.pairs_per_token:g} local routed pairs"
        " (balanced); mitigation columns: bytes saved / time added (forward + backward)",
    ]
    headers = ["op", "Δt_f", "Δt_b", "Δm", *MITIGATIONS]
    body = []
    for r in rows:
        c = r["cost"]
        label = f"{r['kind']}.{c.op.name}"
        body.append(
            [label, fmt_seconds(c.forward_s), fmt_seconds(c.backward_s), fmt_bytes(c.saved_bytes)]
            + [_cell(r, s) for s in MITIGATIONS]
        )
    together = sorted({"+".join(o.name for o in r["unit"]) for r in rows if r["unit"] and len(r["unit"]) > 1})
    notes = [f"* recomputed only together: {', '.join(together)}"] if together else []
    if any(not r["unit"] for r in rows):
        notes.append("n/a: no recompute region replays it")
    out += [table(headers, body), *notes, ""]
    chunks = "" if len(stage.chunks) == 1 else f" (its {len(stage.chunks)} chunk forwards together)"
    out.append(
        f"micro-batch{chunks}: Δt_f {fmt_seconds(mb.forward_s)}, Δt_b {fmt_seconds(mb.backward_s)}, "
        f"Δm {fmt_bytes(mb.activation_bytes)}; M0 (full recompute at {recipe.spikes.normal_max_imbalance:g}x routing"
        f"{', largest chunk' if chunks else ''}) {fmt_bytes(stage.min_budget)}"
    )
    for label, curve in curves:
        phases = {p: sum(1 for s in curve.steps if s.phase == p) for p in ("warmup", "steady", "cooldown")}
        head = stage.capacity - curve.peak_bytes
        verdict = f"headroom {fmt_bytes(head)}" if head >= 0 else f"OUT OF MEMORY by {fmt_bytes(-head)}"
        out.append(
            f"{label}: {phases['warmup']} warmup F, {phases['steady'] // 2} steady F/B, {phases['cooldown']} cooldown B; "
            f"peak {fmt_bytes(curve.peak_bytes)} at the end of F{curve.peak_step.micro_batch} ({curve.peak_step.phase}, "
            f"{curve.in_flight_at_peak} in flight, t = {fmt_seconds(curve.peak_time)}); {verdict}"
        )
    return "\n".join(out)


def _costs(mb: MicroBatchCost) -> dict:
    return {"forward_s": mb.forward_s, "backward_s": mb.backward_s, "activation_bytes": mb.activation_bytes}


def _as_json(stage: Stage, rows: list[dict], curves: list[tuple[str, Curve]], imbalance: list[float], png: str) -> dict:
    mb = stage.micro_batch()
    return {
        "recipe": stage.recipe.model_dump(mode="json"),
        "tokens": stage.tokens,
        "capacity_bytes": stage.capacity,
        "static_bytes": stage.static_bytes,
        "min_budget_bytes": stage.min_budget,
        "micro_batch": _costs(mb),
        "chunks": [_costs(stage.chunk(c).micro_batch()) for c in range(len(stage.chunks))],
        "ops": [
            {
                "layer": r["op"].layer,
                "name": r["op"].name,
                "kind": r["kind"],
                "forward_s": r["cost"].forward_s,
                "backward_s": r["cost"].backward_s,
                "saved_bytes": r["cost"].saved_bytes,
                "recompute_unit": [o.name for o in r["unit"]],
                "mitigation": {
                    s: {"bytes_saved": m.bytes_saved, "forward_s": m.forward_s, "backward_s": m.backward_s}
                    for s, m in r["mitigation"].items()
                },
            }
            for r in rows
        ],
        "curves": [
            {
                "label": label,
                "imbalance": [1.0] * len(imbalance) if i == 0 else imbalance,
                "peak_bytes": c.peak_bytes,
                "peak_time_s": c.peak_time,
                "peak_micro_batch": c.peak_step.micro_batch,
                "peak_phase": c.peak_step.phase,
                "in_flight_at_peak": c.in_flight_at_peak,
                "fits": c.peak_bytes <= stage.capacity,
                "times_s": c.times,
                "bytes": c.bytes,
                "steps": [f"{s.kind}{s.micro_batch}" + (f".{s.chunk}" if len(stage.chunks) > 1 else "") for s in c.steps],
            }
            for i, (label, c) in enumerate(curves)
        ],
        "png": png,
    }


if __name__ == "__main__":
    sys.exit(main())
