"""Tables and memory plots for people: text tables for the terminal, PNG memory curves in the
style of the paper's Fig. 5c (time on x, activation memory on y, the capacity line, phases)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from .costmodel import Curve

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
    colours = ("#1f4e79", "#c0392b", "#7f8c8d", "#d35400", "#7d3c98", "#117a65")
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


def _axes(size: tuple[float, float], nrows: int = 1, sharex: bool = False, height_ratios=None):
    """A figure and its axes, drawn off screen (no display on training machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, figsize=size, sharex=sharex, height_ratios=height_ratios)


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
