"""The `bagualu` command: it parses, calls, and prints what `report` formats. Every error a user can
cause reads `bagualu <command>: error: <message>` on stderr with exit status 2, argparse's own
form, whether argparse finds it or a subcommand does (`CliError`, `RecipeError`, one line per
problem); `validate-recipe` reports every file so, then exits 2 if any failed."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from .config import RecipeError, load_recipe
from .families import FAMILIES
from .hardware import PRESETS
from .report import (
    demo_title,
    plot_curves,
    plot_run,
    plot_timeline,
    profile_text,
    read_run,
    run_text,
    simulation_text,
    stage_json,
    stage_text,
    stage_title,
    summary,
    summary_table,
)
from .stage import Stage
from .units import fmt_bytes


class CliError(SystemExit):
    """Bad input a subcommand found after parsing: a SystemExit with argparse's status 2 whose text
    is the message, so that a command ends as `parser.error` ends it; `main` prints it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 2


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
        help="a subset of adaptive,none,full_recompute,static_average,static_worst,unbounded,oracle"
    )
    d.add_argument("--png", default="demo-timeline.png", help="where to write the memory timeline (default: demo-timeline.png)")
    d.add_argument("--json", default=None, metavar="FILE", help="also write the numbers of every policy as JSON")
    d.add_argument("--seed", type=int, default=0, help="model and batch seed (the spike schedule has the recipe's)")
    d.add_argument(
        "--no-manual-gc", dest="manual_gc", action="store_false",
        help="leave Python's garbage collector automatic (default: frozen after set-up, every rank collecting between iterations)",
    )

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

    rp = sub.add_parser(
        "report", help="draw a training run's telemetry: memory per micro-batch against the capacity and budget, plans, gates, time"
    )
    rp.add_argument("run", metavar="RUN", help="a telemetry file, or the run's output directory (its bagualu-telemetry*.jsonl)")
    rp.add_argument("--out", default=None, metavar="PNG", help="where to draw it (default: bagualu-report.png beside the telemetry)")

    t = sub.add_parser("tiny-checkpoint", help="write a tiny random-init MoE checkpoint and a character-level tokenizer (offline)")
    t.add_argument("family", choices=sorted(FAMILIES), metavar="FAMILY", help=f"one of {', '.join(sorted(FAMILIES))}")
    t.add_argument("directory", metavar="DIR", help="where to save_pretrained the model and the tokenizer")
    t.add_argument("--layers", type=_positive("--layers"), default=None, help="decoder layers (default: the family's tiny default)")
    t.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    return p


def _report(args: argparse.Namespace) -> int:
    try:
        runs = read_run(args.run)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
    run = Path(args.run)
    out = Path(args.out) if args.out else (run if run.is_dir() else run.parent) / "bagualu-report.png"
    print(run_text(runs))
    plot_run(runs, out, run.resolve().name)
    print(f"wrote {out}")
    return 0


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
        return _COMMANDS[args.command](args)
    except (CliError, RecipeError) as exc:
        _error(args.command, exc)
        raise CliError(str(exc)) from None


def _error(command: str, exc: Exception) -> None:
    """One line per problem (a recipe's errors are one a field), each as argparse writes its own."""
    for line in str(exc).splitlines():
        print(f"bagualu {command}: error: {line}", file=sys.stderr)


def _simulate(args: argparse.Namespace) -> int:
    from .sim import read_trace, simulate

    if args.seed is not None and args.seed < 0:
        raise CliError(f"--seed must be >= 0, got {args.seed}")
    if args.trace and args.seed is not None:
        raise CliError("--seed draws a spike trace, --trace replays one: give one of them")
    recipe = load_recipe(args.recipe)
    try:
        trace = read_trace(args.trace, recipe, args.iterations) if args.trace else None
        result = simulate(recipe, args.iterations, args.seed, preset=args.recipe, trace=trace)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
    print(simulation_text(args.recipe, recipe, args.iterations, result, args.trace))
    if args.json:
        result.save(args.json)
        print(f"wrote {args.json}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Every file is checked, each failure reported as it is found; status 2 if any failed."""
    failed = 0
    for path in args.recipes:
        try:
            if _is_nanotron(path):
                print(f"ok: {path} ({_validate_nanotron(path)})")
                continue
            r = load_recipe(path)
            stage = Stage.of(r)
            for rank in range(r.pipeline.pp):  # Algorithm 1 can start on every rank: capacity holds static + M0 in flight
                pipe = r.pipeline.model_copy(update={"rank": rank})
                try:
                    (stage if rank == r.pipeline.rank else Stage.of(r.model_copy(update={"pipeline": pipe}))).budgets()
                except ValueError as exc:
                    raise RecipeError(path, [("hardware.capacity_bytes", str(exc))]) from None
        except RecipeError as exc:
            _error(args.command, exc)
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
        raise CliError(f"--model {args.model}: cannot load a saved model offline ({exc})") from None
    try:
        cm = profile(model.train(), args.tokens, repeats=args.repeats, progress=True)
    except (UnsupportedModelError, ValueError) as exc:
        raise CliError(str(exc)) from None
    cm.save(args.out)
    print(f"{profile_text(cm, max(args.tokens))}; wrote {args.out}")
    return 0


def _recipe(args: argparse.Namespace) -> int:
    import torch

    from .derive import checkpoint_model, recipe_of

    try:
        model = checkpoint_model(args.model)
    except (OSError, ValueError) as exc:
        raise CliError(f"{args.model}: {exc}") from None
    seq_len = args.seq_len or getattr(model.config, "max_position_embeddings", None)
    if seq_len is None:
        raise CliError(f"{args.model} has no max_position_embeddings: give --seq-len")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and not args.capacity:
        raise CliError("no CUDA device here, so no device memory to derive: give --capacity (the simulated capacity, e.g. 8GiB)")
    capacity = int(args.capacity) if args.capacity and args.capacity.isdigit() else args.capacity
    given = {"hardware": {"capacity_bytes": capacity}} if capacity else None
    try:
        recipe = recipe_of(model, given, device=device, processes=1, micro_batches=args.micro_batches,
                           batch={"seq_len": seq_len, "micro_batch_size": args.batch_size})
    except ValueError as exc:
        raise CliError(f"{args.model}: {exc}") from None
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

    from .demo import POLICIES, run_demo

    recipe = load_recipe(args.recipe)
    policies = args.policies or list(POLICIES)
    pipe = recipe.pipeline
    ranks = recipe.parallel.ep
    print(f"bagualu demo: starting {ranks} expert-parallel ranks (one process each), profiling and pretraining", file=sys.stderr)
    try:
        # the bar counts the hot rank's policy iterations, reported as they finish
        with tqdm(total=args.steps * len(policies), desc="policy iterations", unit="it") as bar:
            results = run_demo(recipe, args.steps, policies, seed=args.seed, progress=bar.update, manual_gc=args.manual_gc)
    except ValueError as exc:  # e.g. a capacity that cannot hold M0, found before training
        raise CliError(f"{args.recipe}: {exc}") from None
    rows = summary(results)
    title = demo_title(args.recipe, recipe, args.steps)
    normal_max = recipe.spikes.normal_max_imbalance
    png = plot_timeline(results, args.png, results[0].capacity_bytes, normal_max, 2 * pipe.micro_batches, title)
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
            raise CliError(f"--spike micro-batch {mb} must be in [0, {pipe.micro_batches})")
        if factor <= 0:
            raise CliError(f"--spike imbalance must be > 0, got {factor}")
        imbalance[mb] = factor
    curves = [("balanced routing", stage.curve())]
    if args.spike:
        spikes = ", ".join(f"F{mb} x{f:g}" for mb, f in args.spike)
        curves.append((f"routing spike ({spikes})", stage.curve(imbalance)))
    title = stage_title(args.recipe, stage)
    png = plot_curves(curves, args.png, stage.capacity, stage.static_bytes, title)
    if args.json:
        print(json.dumps(stage_json(stage, curves, imbalance, str(png)), indent=1))
    else:
        print(stage_text(stage, curves, title))
        print(f"\nwrote {png}")
    return 0


_COMMANDS = {
    "validate-recipe": _validate,
    "curve": _curve,
    "demo": _demo,
    "profile": _profile,
    "simulate": _simulate,
    "recipe": _recipe,
    "report": _report,
    "tiny-checkpoint": _tiny_checkpoint,
}


if __name__ == "__main__":
    sys.exit(main())
