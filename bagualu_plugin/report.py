"""What people read: text tables for the terminal, PNG memory curves in the style of the paper's
Fig. 5c (time on x, activation memory on y, the capacity line, phases), and the reports of the
`bagualu` commands (a stage's op costs and curves, a profile, a simulation, the demo's policies,
a training run's telemetry). Pure formatting: the numbers come from the cost model, the
simulator, the demo and the Provisioner's events."""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .config import TELEMETRY_FILE
from .costmodel import MITIGATIONS, CostModel, Curve, Forward, MicroBatchCost
from .stage import Stage
from .units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from .config import Recipe
    from .demo import PolicyResult
    from .sim.run import Simulation

_GIB = 2**30
_MIB = 2**20
_PHASE_COLOURS = {"warmup": "#dbe9f6", "steady": "#e3f1dc", "cooldown": "#f6e3d6"}


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *map(line, cells[1:])])


def plot_curves(
    curves: Sequence[tuple[str, Curve]],
    path: str | Path,
    capacity: float,
    static_bytes: float,
    title: str,
) -> Path:
    """Draw one or more iteration curves of the same schedule. A spike lengthens its curve, so each
    curve's phases get their own row of bands under the plot (and dotted boundaries in its colour);
    the peak labels are stacked above every curve, one row each, highest peak first, so they never
    collide whatever the peaks' positions."""
    fig, (ax, rows) = _axes((11, 6.5), nrows=2, sharex=True, height_ratios=[8, 0.6 + 0.5 * len(curves)])
    colours = dict(zip((label for label, _ in curves), ("#1f4e79", "#d35400", "#7d3c98", "#117a65")))
    ax.axhspan(0, static_bytes / _GIB, color="#cccccc", zorder=1, label="non-activation (weights, grads, optimizer)")
    ax.axhline(capacity / _GIB, color="#c0392b", ls="--", lw=1.5, label=f"capacity {capacity / _GIB:.1f} GiB")
    end = max(c.times[-1] for _, c in curves) * 1e3
    for n, (label, curve) in enumerate(curves):
        colour, times = colours[label], [t * 1e3 for t in curve.times]
        ax.plot(times, [b / _GIB for b in curve.bytes], color=colour, lw=1.3, label=label, zorder=3)
        ax.plot(curve.peak_time * 1e3, curve.peak_bytes / _GIB, "o", color=colour, zorder=4)
        for phase, shade in _PHASE_COLOURS.items():
            idx = [i for i, s in enumerate(curve.steps) if s.phase == phase]
            if not idx:
                continue
            start, stop = times[idx[0]], times[idx[-1] + 1]
            rows.broken_barh([(start, stop - start)], (n - 0.4, 0.8), facecolors=shade, edgecolors=colour, lw=0.8)
            if stop - start > 0.05 * end:  # room for the name
                rows.text((start + stop) / 2, n, phase, ha="center", va="center", fontsize=8)
            if phase != "warmup":
                ax.axvline(start, color=colour, ls=":", lw=0.9, zorder=2)
    # labels in the top band of the axes, which the y range keeps free of curves
    labelled = sorted(curves, key=lambda c: -c[1].peak_bytes)
    band = 0.07  # axes height per label row
    top = max(capacity, *(c.peak_bytes for _, c in curves)) / _GIB
    ax.set_ylim(0, top / (0.95 - band * len(curves)))
    for n, (label, curve) in enumerate(labelled):
        x, right = curve.peak_time * 1e3, curve.peak_time * 1e3 > 0.7 * end
        ax.annotate(
            f"{label}: peak {curve.peak_bytes / _GIB:.2f} GiB at the end of F{curve.peak_step.micro_batch}"
            + (" (OUT OF MEMORY)" if curve.peak_bytes > capacity else ""),
            (x, curve.peak_bytes / _GIB),
            xytext=(x, 0.97 - band * n),  # a vertical leader from the label's corner down to the peak
            textcoords=("data", "axes fraction"),
            ha="right" if right else "left",
            va="top",
            fontsize=8,
            color=colours[label],
            arrowprops={"arrowstyle": "-", "color": colours[label], "lw": 0.8, "relpos": (1 if right else 0, 0)},
        )
    rows.set_yticks(range(len(curves)), [label for label, _ in curves], fontsize=8)
    for tick, (label, _) in zip(rows.get_yticklabels(), curves):
        tick.set_color(colours[label])
    rows.set_ylim(len(curves) - 0.5, -0.5)
    rows.set_xlim(0, end)
    rows.set_xlabel("time on this stage (ms of compute, pipeline bubbles not drawn)")
    ax.set_ylabel("device memory (GiB)")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=10)
    # every curve stays above the non-activation bytes, and mid-iteration above its steady level
    ax.legend(loc="lower center", fontsize=8, ncol=2)
    return _save(fig, path)


def plot_timeline(
    results: Sequence, path: str | Path, capacity: float, normal_max: float, steps: int, title: str
) -> Path:
    """Device memory of every demo policy, step by step (`demo.PolicyResult.timeline`): the peak of
    each forward or backward, the capacity, the adaptive budgets, spiking micro-batches shaded,
    OOMs crossed. `steps`: forwards and backwards per iteration."""
    fig, ax = _axes((12, 5.5))
    colours = ("#1f4e79", "#c0392b", "#7f8c8d", "#d35400", "#7d3c98", "#117a65", "#b7950b", "#2e86c1", "#6e2c00", "#17202a")
    spiked, ooms = set(), []
    for result, colour in zip(results, colours):
        xs, ys, ceilings = [], [], []
        for x, entry in _positions(result.timeline, steps):
            xs.append(x)
            ys.append(entry.peak / _MIB)
            if entry.spike > normal_max and entry.kind == "F":
                spiked.add(round(x, 6))
            if entry.ceiling is not None:
                ceilings.append((x, entry.ceiling / _MIB))
            if entry.oom:
                ooms.append((x, entry.peak / _MIB, colour))
                xs.append(x)
                ys.append(float("nan"))  # the restart: no line to the next iteration
        ax.plot(xs, ys, color=colour, lw=1.0, label=result.policy, zorder=3)
        if ceilings:
            ax.plot(*zip(*ceilings), "_", color=colour, ms=7, label=f"{result.policy}: budget (Algorithm 1)", zorder=4)
    for n, x in enumerate(sorted(spiked)):
        ax.axvspan(x - 1 / steps, x, color="#f9e79f", zorder=0, label="routing spike" if n == 0 else None)
    for n, (x, y, colour) in enumerate(ooms):
        ax.plot(x, y, "x", color=colour, ms=9, mew=2, zorder=5, label="OOM (restart)" if n == 0 else None)
    ax.axhline(capacity / _MIB, color="#c0392b", ls="--", lw=1.5, label=f"capacity {capacity / _MIB:.1f} MiB")
    ax.set_xlabel("iteration (each forward and backward of pipeline rank's 1F1B schedule)")
    ax.set_ylabel("device memory (MiB): peak of each step")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=7, ncol=2)
    return _save(fig, path)



def plot_steps(steps: Sequence[dict], path: str | Path, title: str) -> Path:
    """Peak device bytes of every process at each optimizer step against the capacity (the
    fine-tuning example's `metrics.jsonl` lines: `step`, `peak_device_bytes`, `capacity_bytes`)."""
    fig, ax = _axes((9, 4.5))
    xs = [s["step"] for s in steps]
    for rank in range(len(steps[0]["peak_device_bytes"])):
        ax.plot(xs, [s["peak_device_bytes"][rank] / _MIB for s in steps], marker=".", lw=1.0, label=f"process {rank}: peak")
    ax.axhline(steps[0]["capacity_bytes"] / _MIB, color="#c0392b", ls="--", lw=1.5, label="capacity")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("device memory (MiB): static + activations")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def _positions(timeline: Sequence, steps: int):
    """(x, entry): x = iteration + the step's place among the `steps` of its iteration."""
    place: dict[int, int] = {}
    for entry in timeline:
        i = place[entry.iteration] = place.get(entry.iteration, 0) + 1
        yield entry.iteration + i / steps, entry


def _pyplot():
    """pyplot, drawing off screen (no display on training machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes(size: tuple[float, float], nrows: int = 1, sharex: bool = False, height_ratios=None):
    """A figure and its axes, drawn off screen."""
    return _pyplot().subplots(nrows, figsize=size, sharex=sharex, height_ratios=height_ratios)


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def profile_text(cm: CostModel, tokens: int) -> str:
    """`bagualu profile`'s report: each op's fitted cost (§IV-A) at `tokens` as one sequence."""
    rows = [
        [str(c.op), fmt_seconds(c.forward_s), fmt_seconds(c.backward_s), fmt_bytes(c.saved_bytes)]
        for c in cm.op_costs(Forward(tokens, tokens))
    ]
    saved = fmt_bytes(cm.activation_bytes(tokens, seq_len=tokens))
    return f"{table(['op', 'Δt_f', 'Δt_b', 'Δm'], rows)}\n\nat T = {tokens}: {saved} saved for backward"


def stage_title(name: str, stage: Stage) -> str:
    """The heading of `bagualu curve`'s report and plot: which stage of recipe `name`, on what."""
    pipe = stage.recipe.pipeline
    schedule = "1F1B" if pipe.vp == 1 else f"interleaved 1F1B, {pipe.vp} chunks per rank"
    return (
        f"{name}: stage {pipe.rank}/{pipe.pp} on {stage.recipe.hardware.name}, "
        f"{pipe.micro_batches} micro-batches of {stage.tokens} tokens ({schedule}, nothing mitigated)"
    )


def _op_rows(stage: Stage) -> list[dict]:
    """Each op of the first block of every kind in the stage, with what each mitigation does."""
    cm, seen, rows = stage.cost, set(), []
    seq = stage.recipe.batch.seq_len
    for cost in cm.op_costs(Forward(stage.tokens, seq)):
        kind = cm.blocks[cost.op.layer].kind
        if (kind, cost.op.name) in seen:
            continue
        seen.add((kind, cost.op.name))
        unit = cm.recompute_unit(cost.op)
        mit = {
            s: cm.mitigation_cost(unit if s == "recompute" else cost.op, s, Forward(stage.tokens, seq), options=stage.options)
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


def stage_text(stage: Stage, curves: Sequence[tuple[str, Curve]], title: str) -> str:
    """`bagualu curve`'s report: the stage's layout and parameters, each op's cost and what every
    mitigation would save and cost (§IV-B), the micro-batch and M0, and each curve's verdict."""
    cm, recipe, rows = stage.cost, stage.recipe, _op_rows(stage)
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
        f"Δm {fmt_bytes(mb.activation_bytes)}; M0 (full recompute"
        f"{' with the all-to-alls' if recipe.parallel.dispatches else ''} at {recipe.spikes.spike_max_imbalance:g}x routing"
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


def stage_json(stage: Stage, curves: Sequence[tuple[str, Curve]], imbalance: Sequence[float], png: str) -> dict:
    """`bagualu curve --json`: the numbers of `stage_text`, every curve step by step."""
    mb, rows = stage.micro_batch(), _op_rows(stage)
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


def simulation_text(name: str, recipe: Recipe, iterations: int, result: Simulation, trace: str | None = None) -> str:
    """`bagualu simulate`'s report (§VI): the systems compared, the ablation of Fig. 11 and the
    time BaGuaLu's decisions took; `trace`: the recorded routing replayed, if any."""
    rows = [
        [o.system, f"{100 * o.mfu:.1f}%", f"{o.tokens_per_s:,.0f}", o.ooms, f"{o.speedup_vs_best_baseline:.3f}x", f"{o.iteration_s:.2f} s"]
        for o in result.outcomes
    ]
    routing = f"routing recorded in {trace}" if trace else f"spike seed {result.seed}"
    ablation = [[a.level, f"{a.tokens_per_s:,.0f}", a.ooms, f"{a.speedup_vs_previous:.3f}x"] for a in result.ablation]
    return "\n".join([
        f"SIMULATED: {name}, {recipe.gpus} devices of {recipe.hardware.name}, {iterations} iterations, "
        f"{routing} (cost model times, not measurements)",
        table(["system", "MFU", "tokens/s", "OOMs", "vs best baseline", "iteration"], rows),
        "\nablation (Fig. 11): L1 every layer recomputed, L2 + static fine-grained plans, L3 + dynamic, L4 + fused dual-batch",
        table(["level", "tokens/s", "OOMs", "vs previous"], ablation),
        f"BaGuaLu's decisions per iteration (slowest rank): mean {1e3 * result.decision_s:.2f} ms, "
        f"median {1e3 * result.decision_median_s:.2f} ms, max {1e3 * result.decision_max_s:.2f} ms "
        f"({1e3 * result.decision_warm_max_s:.2f} ms after the first, whose caches start cold; paper: < 10 ms); per chunk forward: "
        f"median {1e3 * statistics.median(result.decision_forward_s):.3f} ms, first {1e3 * result.decision_forward_s[0]:.2f} ms",
    ])


def demo_title(name: str, recipe: Recipe, steps: int) -> str:
    """The heading of `bagualu demo`'s table and timeline: the run of recipe `name` it shows."""
    par, pipe, spikes = recipe.parallel, recipe.pipeline, recipe.spikes
    return (
        f"{name}: {steps} iterations x {pipe.micro_batches} micro-batches of {recipe.batch.tokens} tokens per rank, "
        f"pipeline rank {pipe.rank}/{pipe.pp}, EP rank {par.ep_rank} of {par.ep} processes (its memory; the job's tokens/s), "
        f"spikes in {spikes.spike_probability:.1%} of iterations up to {spikes.spike_max_imbalance}x"
    )


def summary(results: Sequence[PolicyResult]) -> list[dict]:
    """Per policy: the numbers of `bagualu demo --json`, throughput also as a ratio to full
    recompute, to the oracle (the best plans at this capacity) and to the unbounded run (the
    limit), measured in the same run, when those ran."""
    by = {r.policy: r for r in results}

    def vs(r: PolicyResult, policy: str) -> float | None:
        base = by.get(policy)
        return r.tokens_per_s / base.tokens_per_s if base is not None and base.tokens_per_s else None

    return [
        {
            "policy": r.policy,
            "steps_completed": r.steps_completed,
            "ooms": r.ooms,
            "tokens_per_s": r.tokens_per_s,
            "vs_full_recompute": vs(r, "full_recompute"),
            "vs_oracle": vs(r, "oracle"),
            "vs_unbounded": vs(r, "unbounded"),
            "peak_device_bytes": r.peak_device_bytes,
            "capacity_bytes": r.capacity_bytes,
            "rank": r.rank,
            "rank_peak_device_bytes": r.rank_peak_device_bytes,
            "planner_ms_per_micro_batch": r.planner_ms_per_micro_batch,
            "missed_forwards": r.missed_forwards,
            "seconds": r.seconds,
        }
        for r in results
    ]


def summary_table(rows: Sequence[dict]) -> str:
    """`summary`'s rows as `bagualu demo`'s table."""
    return table(
        ["policy", "steps", "OOMs", "tokens/s", "vs full recompute", "vs oracle", "vs unbounded", "peak device", "capacity",
         "planner ms/mb"],
        [
            [
                r["policy"], r["steps_completed"], r["ooms"], f"{r['tokens_per_s']:.0f}",
                *("-" if r[k] is None else f"{r[k]:.2f}x" for k in ("vs_full_recompute", "vs_oracle", "vs_unbounded")),
                fmt_bytes(r["peak_device_bytes"]), fmt_bytes(r["capacity_bytes"]), f"{r['planner_ms_per_micro_batch']:.2f}",
            ]
            for r in rows
        ],
    )


_STRATEGY_COLOURS = {"recompute": "#e67e22", "offload": "#2e86c1", "fp8": "#8e44ad"}


def read_run(run: str | Path) -> dict[str, list[dict]]:
    """A run's telemetry (`bagualu report RUN`): a Provisioner's events file, or the output
    directory holding one per rank (`bagualu-telemetry.jsonl`, or `bagualu-telemetry.rank<R>.jsonl`
    each), as {label: events in forward order}."""
    run = Path(run)
    if run.is_dir():
        stem = Path(TELEMETRY_FILE).stem
        files = sorted(run.glob(f"{stem}*.jsonl"), key=lambda p: (len(p.name), p.name))
        if not files:
            raise FileNotFoundError(f"{run}: no {TELEMETRY_FILE} (or {stem}.rank<R>.jsonl) in this directory")
    elif run.exists():
        files = [run]
    else:
        raise FileNotFoundError(f"{run}: no such telemetry file or output directory")
    runs = {}
    for path in files:
        events = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                event = json.loads(line)
                event["forward"], event["device_bytes"]
            except (json.JSONDecodeError, TypeError, KeyError):
                raise ValueError(f"{path}:{n}: not a telemetry event (one JSON object per line, as the Provisioner writes them)") from None
            events.append(event)
        if not events:
            raise ValueError(f"{path}: no micro-batch ended its backward in this run")
        label = path.stem.rsplit(".", 1)[-1].replace("rank", "rank ") if len(files) > 1 else "run"
        runs[label] = sorted(events, key=lambda e: e["forward"])
    return runs


def run_summary(events: Sequence[dict]) -> dict:
    """One rank's run in numbers: micro-batches, how many ran a plan, the share of their
    activations the plans took off, the gates' escalations and deferrals, the peak against the
    capacity, the time mitigation added as the cost model prices it, the planner's time."""
    taken = sum(sum(e["mitigated"].values()) for e in events)
    kept = sum(e["actual"] for e in events)
    return {
        "micro_batches": len(events),
        "mitigated": sum(1 for e in events if e["plan"]),
        "mitigated_share": taken / (kept + taken) if kept + taken else 0.0,
        "escalations": sum(len(e["escalations"]) for e in events),
        "deferrals": sum(len(e["deferred"]) for e in events),
        "peak_device_bytes": max(e["peak_device_bytes"] for e in events),
        "capacity_bytes": max(e["capacity"] for e in events),
        "mitigation_s": sum(e["mitigation_s"] for e in events),
        "planner_s": sum(e["planner_s"] for e in events),
    }


def run_text(runs: dict[str, Sequence[dict]]) -> str:
    """`bagualu report`'s table: `run_summary` per rank."""
    rows = []
    for label, events in runs.items():
        s = run_summary(events)
        rows.append([
            label, s["micro_batches"], f"{s['mitigated']} ({s['mitigated'] / s['micro_batches']:.0%})",
            f"{s['mitigated_share']:.1%}", s["escalations"], s["deferrals"],
            f"{fmt_bytes(s['peak_device_bytes'])} of {fmt_bytes(s['capacity_bytes'])}",
            fmt_seconds(s["mitigation_s"]), fmt_seconds(s["planner_s"]),
        ])
    headers = ["run", "micro-batches", "with a plan", "activations taken off", "escalations", "deferrals", "peak device",
               "mitigation (priced)", "planner"]
    return table(headers, rows)


def plot_run(runs: dict[str, Sequence[dict]], path: str | Path, title: str) -> Path:
    """A run's picture, one column per rank, per micro-batch in forward order: the device peak
    against the capacity; what its activations kept (measured) under the bytes its plan took off,
    by strategy, with the budget Algorithm 1 gave it and its gates' escalations and deferrals
    marked; the planner's time and the time its plan adds as the cost model prices it. Under
    it, `run_text`'s numbers."""
    fig = _pyplot().figure(figsize=(max(11.0, 5.5 * len(runs)), 9.5))
    grid = fig.add_gridspec(4, len(runs), height_ratios=[3, 3.2, 1.6, 0.35 + 0.28 * len(runs)])
    for col, (label, events) in enumerate(runs.items()):
        xs = list(range(len(events)))
        device, acts, times = (fig.add_subplot(grid[row, col]) for row in range(3))
        capacity = max(e["capacity"] for e in events)
        device.plot(xs, [e["device_bytes"] / _MIB for e in events], ".-", color="#1f4e79", lw=1, label="at its forward's end")
        device.plot(xs, [e["peak_device_bytes"] / _MIB for e in events], color="#7f8c8d", lw=1, ls=":", label="peak so far")
        device.axhline(capacity / _MIB, color="#c0392b", ls="--", lw=1.5, label=f"capacity {fmt_bytes(capacity)}")
        device.set_title(f"{label}: {title}" if len(runs) > 1 else title, fontsize=9)
        device.set_ylim(top=1.03 * capacity / _MIB)
        device.set_ylabel("device memory (MiB)")
        device.legend(loc="lower right", fontsize=7)
        bottom = [e["actual"] / _MIB for e in events]
        acts.bar(xs, bottom, width=0.8, color="#5d6d7e", label="kept (measured)")
        for strategy, colour in _STRATEGY_COLOURS.items():
            heights = [e["mitigated"].get(strategy, 0.0) / _MIB for e in events]
            if any(heights):
                acts.bar(xs, heights, width=0.8, bottom=bottom, color=colour, label=f"taken off: {strategy}")
                bottom = [b + h for b, h in zip(bottom, heights)]
        acts.step(xs, [e["budget"] / _MIB for e in events], where="mid", color="black", lw=1, label="budget (Algorithm 1)")
        top = max(bottom + [e["budget"] / _MIB for e in events])
        for key, marker, name in (("escalations", "^", "gate escalated"), ("deferred", "D", "gate deferred")):
            marked = [x for x, e in zip(xs, events) if e[key]]
            if marked:
                acts.plot(marked, [top * 1.06] * len(marked), marker, color="#c0392b", ms=5, ls="none", label=name)
        acts.set_ylim(top=1.45 * top)  # room for the legend above the bars
        acts.set_ylabel("activations (MiB)")
        acts.legend(loc="upper right", fontsize=7, ncol=3)
        times.bar(xs, [e["planner_s"] * 1e3 for e in events], width=0.8, color="#95a5a6", label="planner")
        times.plot(xs, [e["mitigation_s"] * 1e3 for e in events], ".", color="#e67e22", label="mitigation (priced)")
        times.set_ylabel("ms")
        times.set_xlabel("micro-batch (forward order)")
        times.legend(loc="upper right", fontsize=7)
    text = fig.add_subplot(grid[3, :])
    text.axis("off")
    text.text(0, 1, run_text(runs), family="monospace", fontsize=8, va="top")
    return _save(fig, path)
