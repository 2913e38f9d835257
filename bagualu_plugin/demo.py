"""The spike demo: adaptive provisioning against static policies on one real model (paper §II-B,
§VI-C), on CPU with a simulated device capacity (DESIGN.md section 6).

A tiny GLM-4-MoE runs as one rank of a 1F1B pipeline and of emulated expert parallelism, with
the recipe's routing spikes (97.1% of iterations under 1.2x, 2.9% up to 2.6x by default, or as
configured). Every policy runs the same iterations on its own copy of the model:

- adaptive: `bgl.apply` (per-micro-batch budgets, plans, gate-time escalation);
- none: nothing mitigated (under-provisioned);
- full_recompute: every decoder layer recomputed (over-provisioned);
- static_average / static_worst: one per-op plan for all micro-batches, sized by Algorithm 2 for
  the normal band (AdaPipe-like) or for the largest spike.

A static policy that runs out of memory is handled as the paper does: the OOM is counted, a
restart costs `spikes.restart_iterations` times its mean iteration time, and it continues with
full recompute. Policies take turns iteration by iteration, so a slow spell of a shared machine
costs them all alike and the throughput ratios of one run can be trusted.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from .adapters import Adapter, tiny_model
from .adapters.experts import set_expert_parallel
from .adapters.gate import RoutingSkew
from .config import Recipe
from .costmodel import CostModel, ModelDims
from .costmodel.pipeline import one_f_one_b
from .costmodel.plan import Plan
from .planner import plan_micro_batch
from .runtime.ledger import SimulatedOutOfMemoryError
from .runtime.plan_runtime import PlanRuntime
from .runtime.profiler import profile
from .runtime.provisioner import Provisioner
from .report import table
from .spikes import imbalance_schedule, skew_fraction
from .units import fmt_bytes

POLICIES = ("adaptive", "none", "full_recompute", "static_average", "static_worst")


@dataclass
class PolicyResult:
    policy: str
    steps_completed: int
    ooms: int
    seconds: float  # compute time plus charged restarts
    tokens: int
    peak_device_bytes: int  # static bytes plus the activation peak
    capacity_bytes: int
    forwards: int = 0
    planner_s: float = 0.0
    # one entry per forward or backward: iteration, micro_batch, kind, live and peak device bytes,
    # spike (the micro-batch's largest imbalance), ceiling (adaptive forwards: the bytes before it
    # plus its budget), oom
    timeline: list[dict] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def planner_ms_per_micro_batch(self) -> float:
        return self.planner_s * 1e3 / self.forwards if self.forwards else 0.0


def demo_model(dims: ModelDims, seed: int = 0):
    """A random-init GLM-4-MoE with the recipe's dimensions (tiny by design)."""
    return tiny_model(
        "glm4_moe",
        seed=seed,
        hidden_size=dims.hidden_size,
        num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_attention_heads,
        num_key_value_heads=dims.num_key_value_heads,
        head_dim=dims.head_dim,
        vocab_size=dims.vocab_size,
        n_routed_experts=dims.num_experts,
        num_experts_per_tok=dims.top_k,
        moe_intermediate_size=dims.moe_intermediate_size,
        n_shared_experts=1 if dims.shared_expert_intermediate_size else 0,
        first_k_dense_replace=dims.first_k_dense,
        intermediate_size=dims.dense_intermediate_size or dims.moe_intermediate_size,
    )


def demo_cost(recipe: Recipe, seed: int = 0) -> CostModel:
    """The demo model's cost model, profiled as the emulation runs (its routing and remote
    experts included), so predicted bytes are exact."""
    model, par, tokens = demo_model(recipe.model, seed), recipe.parallel, recipe.batch.tokens
    return profile(model, [tokens // 4, tokens // 2, tokens], ep_size=par.ep, ep_rank=par.ep_rank, repeats=1)


def _static_plan(policy: str, recipe: Recipe, cm: CostModel, warmup: int) -> Plan:
    if policy == "none":
        return Plan()
    if policy == "full_recompute":
        return Plan(cm.full_recompute())
    share = (recipe.hardware.capacity_bytes - recipe.budget.reserve_bytes - _static_bytes(recipe)) // warmup
    spikes, tokens = recipe.spikes, recipe.batch.tokens
    imbalance = spikes.normal_max_imbalance if policy == "static_average" else spikes.spike_max_imbalance
    routed = [tokens * cm.pairs_per_token * imbalance] * len(cm.moe_layers)
    return plan_micro_batch(cm, share, tokens, routed, recipe.batch.seq_len, recipe.strategies.allowed).plan


def _static_bytes(recipe: Recipe) -> int:
    value = recipe.budget.non_activation_bytes
    if value == "auto":
        raise ValueError("the demo needs budget.non_activation_bytes as a number (its model's weights are not on the simulated device)")
    return value


class PolicyRun:
    """One policy's model, runtime and counters; `iteration(it)` runs one training iteration."""

    def __init__(self, policy: str, recipe: Recipe, cost: CostModel, schedule: list, batches: list, seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.recipe, self.cost, self.schedule, self.batches = recipe, cost, schedule, batches
        self.model = demo_model(recipe.model, seed)
        self.adapter = Adapter(self.model)
        set_expert_parallel(self.adapter, recipe.parallel.ep, recipe.parallel.ep_rank)
        pipe = recipe.pipeline
        self.warmup = min(pipe.pp - pipe.rank, pipe.micro_batches)
        self.current, self.runner = policy, None
        self.static = _static_bytes(recipe)
        self.result = PolicyResult(policy, 0, 0, 0.0, 0, 0, recipe.hardware.capacity_bytes)
        self._times: list[float] = []
        self._install()  # a capacity that cannot hold M0 fails here, before any training

    def _install(self) -> None:
        if self.current == "adaptive":
            self.runner = Provisioner(self.model, self.recipe, self.cost)
            return
        capacity = self.recipe.hardware.capacity_bytes - self.recipe.budget.reserve_bytes
        self.runner = PlanRuntime(self.model, capacity_bytes=capacity, static_bytes=self.static).install()
        self.runner.set_plan(_static_plan(self.current, self.recipe, self.cost, self.warmup))

    def iteration(self, it: int) -> None:
        """One iteration of pipeline rank `pipeline.rank`; an OOM restarts with full recompute."""
        if self.runner is None:  # installed once; again only after a restart
            self._install()
        pipe, par, batch, result = self.recipe.pipeline, self.recipe.parallel, self.recipe.batch, self.result
        ledger, adaptive = self.runner.ledger, self.current == "adaptive"
        start, losses = time.perf_counter(), {}
        try:
            for step in one_f_one_b(pipe.pp, pipe.rank, pipe.micro_batches):
                mb, imbalance = step.micro_batch, self.schedule[it][step.micro_batch]
                ledger.reset_peak()
                entry = {"iteration": it, "micro_batch": mb, "kind": step.kind, "spike": max(imbalance.values())}
                # the micro-batch's routing skew stays for its backward: a recompute routes as the forward did
                with ExitStack() as stack:
                    for layer, x in imbalance.items():
                        fraction = skew_fraction(min(x, par.ep), par.ep)
                        stack.enter_context(RoutingSkew(self.adapter, fraction, par.ep, par.ep_rank, layers=[layer]))
                    if step.kind == "B":
                        losses.pop(mb).backward()
                        if adaptive:
                            self.runner.end_backward(mb)
                    elif adaptive:
                        before = self.static + ledger.live_device_bytes
                        self.runner.begin_forward(mb, batch.tokens, batch.seq_len, phase=step.phase, in_flight=len(losses))
                        try:
                            losses[mb] = self._loss(mb)
                        finally:
                            self.runner.end_forward(mb)
                        event = self.runner.events[-1]  # what Algorithm 1 allowed, with what later warmup
                        given = sum(d["overrun"] for d in event["deferred"])  # micro-batches gave up
                        entry["ceiling"] = before + event["budget"] + given
                    else:
                        ledger.micro_batch = mb
                        with self.runner.forward():
                            losses[mb] = self._loss(mb)
                entry.update(live=self.static + ledger.live_device_bytes, peak=self.static + ledger.peak_device_bytes)
                result.timeline.append(entry)
                result.peak_device_bytes = max(result.peak_device_bytes, entry["peak"])
            elapsed = time.perf_counter() - start
            self._times.append(elapsed)
            result.seconds += elapsed
            result.steps_completed += 1
            result.tokens += batch.tokens * pipe.micro_batches
        except SimulatedOutOfMemoryError as oom:
            losses.clear()
            result.ooms += 1
            # the step that ran out (a forward: only forwards save); its peak is what it asked for
            entry.update(oom=True, live=self.static + oom.live_bytes, peak=self.static + oom.live_bytes + oom.requested_bytes)
            result.timeline.append(entry)
            mean = sum(self._times) / len(self._times) if self._times else time.perf_counter() - start
            result.seconds += self.recipe.spikes.restart_iterations * mean  # a cold restart
            self.close()
            self.current = "full_recompute"  # then the conservative policy

    def _loss(self, mb: int) -> torch.Tensor:
        ids = self.batches[mb]
        return self.model(input_ids=ids, labels=ids).loss

    def close(self) -> PolicyResult:
        if isinstance(self.runner, Provisioner):
            self.result.forwards += self.runner.forwards
            self.result.planner_s += self.runner.planner_s
        if self.runner is not None:
            self.runner.remove()
            self.runner = None
        return self.result


def _caching_host_allocator() -> None:
    """Keep freed host memory for reuse, as a GPU's caching allocator does, for the rest of the
    process. By default glibc maps every block over 128 KiB afresh and unmaps it when freed, so a
    policy that keeps more activations alive pays page faults per allocation that no GPU run pays
    (15% of an iteration of the demo without mitigation). No-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


def run_demo(
    recipe: Recipe,
    steps: int,
    policies: Sequence[str] = POLICIES,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[PolicyResult]:
    """`steps` iterations of every policy on the same batches and spike schedule, the policies
    taking turns each iteration. `progress(n)` is called after every policy iteration."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"policies must be a non-empty subset of {POLICIES}, got {list(policies)}")
    _caching_host_allocator()
    cost = demo_cost(recipe, seed)
    schedule = imbalance_schedule(recipe.spikes, steps, recipe.pipeline.micro_batches, cost.moe_layers)
    generator = torch.Generator().manual_seed(seed)
    batch = recipe.batch
    batches = [
        torch.randint(0, recipe.model.vocab_size, (batch.micro_batch_size, batch.seq_len), generator=generator)
        for _ in range(recipe.pipeline.micro_batches)
    ]
    runs = [PolicyRun(p, recipe, cost, schedule, batches, seed) for p in policies]
    # What exists now (models, cost model, torch and HF modules) lives to the end: freeze it out
    # of the collector, as long training loops do, or each full collection walks it all (0.2 s
    # here, at random iterations of random policies)
    gc.freeze()
    try:
        for it in range(steps):
            for run in runs:
                run.iteration(it)
                if progress:
                    progress(1)
    finally:
        gc.unfreeze()
        results = [run.close() for run in runs]
    return results


def run_policy(policy: str, recipe: Recipe, steps: int, seed: int = 0) -> PolicyResult:
    """`steps` iterations of one policy (see `run_demo`)."""
    return run_demo(recipe, steps, [policy], seed)[0]


def summary(results: Sequence[PolicyResult]) -> list[dict]:
    """Per policy: the numbers of `bagualu demo --json`, throughput also as a ratio to full
    recompute (measured in the same run) when that policy ran."""
    baseline = next((r for r in results if r.policy == "full_recompute"), None)
    return [
        {
            "policy": r.policy,
            "steps_completed": r.steps_completed,
            "ooms": r.ooms,
            "tokens_per_s": r.tokens_per_s,
            "vs_full_recompute": r.tokens_per_s / baseline.tokens_per_s if baseline and baseline.tokens_per_s else None,
            "peak_device_bytes": r.peak_device_bytes,
            "capacity_bytes": r.capacity_bytes,
            "planner_ms_per_micro_batch": r.planner_ms_per_micro_batch,
            "seconds": r.seconds,
        }
        for r in results
    ]


def summary_table(rows: Sequence[dict]) -> str:
    return table(
        ["policy", "steps", "OOMs", "tokens/s", "vs full recompute", "peak device", "capacity", "planner ms/mb"],
        [
            [
                r["policy"], r["steps_completed"], r["ooms"], f"{r['tokens_per_s']:.0f}",
                "-" if r["vs_full_recompute"] is None else f"{r['vs_full_recompute']:.2f}x",
                fmt_bytes(r["peak_device_bytes"]), fmt_bytes(r["capacity_bytes"]), f"{r['planner_ms_per_micro_batch']:.2f}",
            ]
            for r in rows
        ],
    )
