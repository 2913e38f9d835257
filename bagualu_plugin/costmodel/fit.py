"""Fitting `LinearForm`s to measurements (paper §IV-A: every cost is linear in the load).

Numbers in, numbers out: the profiler measures bytes and seconds at a few loads, this module finds
the coefficients. Each operator gets the basis its work scales with: expert operators the routed
pairs S, attention the tokens T and score pairs Q, every other operator T; a constant is always
allowed (index offsets, scalars, launch overhead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .graph import COMM_OPS, EXPERT_OPS, BlockGraph, OpSpec, TensorSpec
from .linear import LinearForm, Load

COEFFICIENTS = ("const", "per_token", "per_routed", "per_score", "per_position", "per_sequence", "per_single", "per_single_token")
_COLUMN = {
    "const": lambda load: 1.0,
    "per_token": lambda load: load.tokens,
    "per_routed": lambda load: load.routed,
    "per_score": lambda load: load.score_pairs,
    "per_position": lambda load: load.positions,
    "per_sequence": lambda load: load.sequences,
    "per_single": lambda load: load.single,
    "per_single_token": lambda load: load.single_tokens,
}


def fit_linear(loads: Sequence[Load], values: Sequence[float], basis: Sequence[str]) -> LinearForm:
    """Least-squares coefficients of `basis` (a subset of COEFFICIENTS) through (load, value)."""
    unknown = set(basis) - set(COEFFICIENTS)
    if unknown:
        raise ValueError(f"unknown coefficients {sorted(unknown)}; expected some of {COEFFICIENTS}")
    if len(loads) != len(values):
        raise ValueError(f"{len(loads)} loads but {len(values)} values")
    a = np.array([[_COLUMN[c](load) for c in basis] for load in loads], dtype=np.float64)
    if np.linalg.matrix_rank(a) < len(basis):
        raise ValueError(
            f"the loads do not determine {list(basis)}: vary tokens, routed pairs and sequence length "
            f"independently ({len(loads)} loads, rank {np.linalg.matrix_rank(a)})"
        )
    coef, *_ = np.linalg.lstsq(a, np.asarray(values, dtype=np.float64), rcond=None)
    return LinearForm(**{c: float(x) for c, x in zip(basis, coef)})


def max_residual(form: LinearForm, loads: Sequence[Load], values: Sequence[float]) -> float:
    return max((abs(form.at(load) - v) for load, v in zip(loads, values)), default=0.0)


# ------------------------------------------------------------------------------------------------
# From profiled samples to operator graphs


@dataclass(frozen=True)
class TensorSample:
    """One saved storage seen in one profiled forward: who made it, who saved it, its size."""

    producer: str  # op name inside the block, or INPUT
    savers: tuple[str, ...]
    itemsize: int
    floating: bool
    nbytes: int
    shared: bool = False  # handed to every layer as an argument (RoPE tables, masks)
    held_by: tuple[int, ...] = ()  # a layer argument nothing saves: held by these layers' regions
    receivers: tuple[str, ...] = ()  # ops recomputed alone that take it as an argument (and hold it)
    chunked: bool | None = None  # saved on one path of the head's loss only (`TensorSpec.chunked`)


@dataclass(frozen=True)
class BlockSample:
    """One block in one profiled forward/backward: its load, ops in program order, saved storages
    in the order they were first saved, and the seconds each op took."""

    kind: str
    load: Load
    ops: tuple[str, ...]
    tensors: tuple[TensorSample, ...]
    forward_s: dict[str, float]
    backward_s: dict[str, float]


def memory_basis(op: str, routed_independent: bool) -> list[str]:
    """Expert ops and expert parallelism's dispatch / combine scale with routed pairs (and with
    tokens only where pairs vary on their own); everything else with tokens, score pairs
    (attention), positions (tables shared by the sequences of a batch), sequences and
    single-sequence tokens (kernels that keep a view for one sequence)."""
    if op in EXPERT_OPS + COMM_OPS:
        return ["const", "per_token", "per_routed"] if routed_independent else ["const", "per_routed"]
    return ["const", "per_token", "per_score", "per_position", "per_sequence", "per_single", "per_single_token"]


def time_basis(op: str) -> list[str]:
    if op in COMM_OPS:  # the rows this rank sends (its tokens) and receives (its pairs)
        return ["const", "per_token", "per_routed"]
    if op in EXPERT_OPS:
        return ["const", "per_routed"]
    return ["const", "per_token", "per_score"] if op == "attn_core" else ["const", "per_token"]


def _snap(form: LinearForm) -> LinearForm:
    """Element counts have integer coefficients; remove the float noise of least squares."""
    return LinearForm(**{c: float(round(v)) if abs(v - round(v)) < 1e-6 else v for c, v in asdict(form).items()})


def _fit_time(op: str, loads: list[Load], seconds: list[float]) -> LinearForm:
    """Least squares on the op's basis, dropping coefficients that come out negative (noise)."""
    basis = time_basis(op)
    while True:
        form = fit_linear(loads, seconds, basis)
        negative = [c for c in basis if getattr(form, c) < 0]
        if not negative:
            return form
        basis = [c for c in basis if c not in negative] or ["const"]


def _align(samples: Sequence[BlockSample]) -> list[list[TensorSample]]:
    """The same saved storages in every sample, as columns: `columns[i][r]` is storage i in run r.

    Storages are matched by who saves them (savers, itemsize, floating) and, within that, in the
    order they were saved. Where runs disagree on which op made them (a kernel copies its input
    for some batch shapes only, e.g. a non-contiguous layout), the group is merged into one
    tensor charged to the op that made most of its bytes: memory stays exact, the attribution
    of that group is approximate.
    """
    first = samples[0]
    for s in samples[1:]:
        if s.kind != first.kind or s.ops != first.ops:
            raise ValueError(f"{first.kind} block: ops differ between profiled runs ({first.ops} vs {s.ops})")
    groups: dict[tuple, list[list[TensorSample]]] = {}
    for r, s in enumerate(samples):
        for t in s.tensors:
            key = (t.savers, t.itemsize, t.floating, t.shared, t.held_by, t.receivers, t.chunked)
            runs = groups.setdefault(key, [[] for _ in samples])
            runs[r].append(t)
    columns = []
    for key, runs in groups.items():
        if any(not run for run in runs):
            raise ValueError(
                f"{first.kind} block: a tensor saved by {key[0]} appears in some profiled runs only; "
                "the model's graph depends on the input"
            )
        producers = [[t.producer for t in run] for run in runs]
        if all(p == producers[0] for p in producers):
            columns += [list(col) for col in zip(*runs)]
            continue
        weight: dict[str, int] = {}
        for run in runs:
            for t in run:
                weight[t.producer] = weight.get(t.producer, 0) + t.nbytes
        producer = max(weight, key=weight.get)
        columns.append([TensorSample(producer, key[0], key[1], key[2], sum(t.nbytes for t in run), *key[3:]) for run in runs])
    return columns


def fit_block(
    samples: Sequence[BlockSample],
    routed_independent: bool,
    dense_params: int = 0,
    expert_params: int = 0,
    units: tuple[tuple[str, ...], ...] = (),
    spans: tuple[tuple[str, ...], ...] = (),
    frozen_params: tuple[int, int] = (0, 0),
) -> BlockGraph:
    """A `BlockGraph` whose tensor sizes reproduce every sample exactly (or an error saying which
    tensor does not) and whose op times are least-squares fits."""
    first = samples[0]
    loads = [s.load for s in samples]
    tensors = []
    columns = _align(samples)
    for i, column in enumerate(columns):
        t = column[0]
        op = t.producer if t.producer in first.ops else (t.savers or first.ops)[0]
        elements = [c.nbytes / t.itemsize for c in column]
        form = _snap(fit_linear(loads, elements, memory_basis(op, routed_independent)))
        if max_residual(form, loads, elements) > 0.5:
            raise ValueError(f"{first.kind} block: saved tensor {i} of {op} is not linear in the load: {elements}")
        tensors.append(TensorSpec(f"{op}.{i}", t.producer, t.savers, form, t.itemsize, t.floating, t.shared, t.held_by, t.chunked))

    def inputs(op: str) -> tuple[str, ...]:
        """What an op reads, as far as memory is concerned (what a recompute region holds): the
        arguments it receives when recomputed alone, and tensors it saves that other ops made."""
        return tuple(t.name for t, s in zip(tensors, columns) if op in s[0].receivers or (op in t.savers and t.producer != op))

    ops = tuple(
        OpSpec(
            op,
            inputs(op),
            _fit_time(op, loads, [s.forward_s.get(op, 0.0) for s in samples]),
            _fit_time(op, loads, [s.backward_s.get(op, 0.0) for s in samples]),
        )
        for op in first.ops
    )
    return BlockGraph(first.kind, ops, tuple(tensors), dense_params, expert_params, units, spans, frozen_params)
