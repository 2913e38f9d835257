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

Every iteration runs through the one 1F1B driver (`runtime.driver.run_iteration`) and ends with
an AdamW step, the same for every policy, so the router trains and routing evolves as in training.
The step is not timed: it is the same work under every policy, and the throughput compares what
the policies change. Every policy starts from the same weights, a few steps into training
(`pretrained`).
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from .adapters import Adapter, tiny_model
from .adapters.experts import set_expert_parallel
from .adapters.gate import RoutingSkew
from .config import Recipe
from .costmodel import CostModel, ModelDims
from .costmodel.pipeline import Step
from .costmodel.plan import Plan
from .planner import plan_micro_batch
from .report import table
from .runtime.driver import run_iteration
from .runtime.ledger import SimulatedOutOfMemoryError
from .runtime.plan_runtime import PlanRuntime
from .runtime.profiler import profile
from .runtime.provisioner import Provisioner
from .spikes import imbalance_schedule, skew_fraction
from .stage import Stage
from .units import fmt_bytes

POLICIES = ("adaptive", "none", "full_recompute", "static_average", "static_worst")
LEARNING_RATE = 1e-3  # AdamW's
PRETRAIN_STEPS = 5


@dataclass
class TimelineEntry:
    """One forward or backward of a policy's iteration; bytes include the static bytes."""

    iteration: int
    micro_batch: int
    kind: str  # "F" or "B"
    spike: float  # the micro-batch's largest imbalance
    live: int = 0  # after the step
    peak: int = 0  # the step's peak; for the step that ran out of memory, what it asked for
    ceiling: int | None = None  # adaptive forwards: the bytes before it plus its budget (Algorithm 1)
    oom: bool = False


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
    timeline: list[TimelineEntry] = field(default_factory=list)

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


def demo_stage(recipe: Recipe, cost: CostModel) -> Stage:
    """The pipeline stage the demo model is: the whole model, its cost model profiled."""
    if recipe.budget.non_activation_bytes == "auto":
        raise ValueError("the demo needs budget.non_activation_bytes as a number (its model's weights are not on the simulated device)")
    return Stage.of(recipe, cost, split=False)


def pretrained(stage: Stage, batches: Sequence[torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights every policy starts from: the seeded model after `PRETRAIN_STEPS` steps of
    plain training on the batches. The random-init router sends this EP rank 1.2-1.5x its
    balanced share of routed pairs, as much as a spike, and the first steps of training take that
    away (measured: the unmitigated peak drops from 57.6 to 50.6-53.5 MiB); starting past them,
    the memory the policies meet follows the spike schedule, as in the paper."""
    model = demo_model(stage.recipe.model, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for _ in range(PRETRAIN_STEPS):
        run_iteration(model, batches, stage.schedule)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def _static_plan(policy: str, stage: Stage) -> Plan:
    if policy == "none":
        return Plan()
    if policy == "full_recompute":
        return Plan(stage.cost.full_recompute())
    recipe, cm = stage.recipe, stage.cost
    share = (stage.capacity - stage.static_bytes) // stage.warmup
    spikes, tokens = recipe.spikes, stage.tokens
    imbalance = spikes.normal_max_imbalance if policy == "static_average" else spikes.spike_max_imbalance
    routed = [tokens * cm.pairs_per_token * imbalance] * len(cm.moe_layers)
    return plan_micro_batch(cm, share, tokens, routed, recipe.batch.seq_len, recipe.strategies.allowed).plan


class PolicyRun:
    """One policy's model, optimizer, runtime and counters; `iteration(it)` runs one training
    iteration. `start`: the weights its model starts from, the same for every policy."""

    def __init__(self, policy: str, stage: Stage, schedule: list, batches: list, start: dict[str, torch.Tensor]):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.stage, self.schedule, self.batches = stage, schedule, batches
        self.model = demo_model(stage.recipe.model)
        self.model.load_state_dict(start)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)
        self.adapter = Adapter(self.model)
        par = stage.recipe.parallel
        set_expert_parallel(self.adapter, par.ep, par.ep_rank)
        self.current, self.runner = policy, None
        self.result = PolicyResult(policy, 0, 0, 0.0, 0, 0, stage.capacity)
        self._times: list[float] = []
        self._install()  # a capacity that cannot hold M0 fails here, before any training

    def _install(self) -> None:
        if self.current == "adaptive":
            self.runner = Provisioner(self.model, self.stage.recipe, self.stage.cost)
            return
        self.runner = PlanRuntime(self.model, capacity_bytes=self.stage.capacity, static_bytes=self.stage.static_bytes).install()
        self.runner.set_plan(_static_plan(self.current, self.stage))

    def iteration(self, it: int) -> None:
        """One iteration of pipeline rank `pipeline.rank`, then the optimizer step; an OOM drops
        the iteration's gradients and restarts with full recompute."""
        if self.runner is None:  # installed once; again only after a restart
            self._install()
        stage, result = self.stage, self.result
        adaptive, ledger, static = self.current == "adaptive", self.runner.ledger, stage.static_bytes
        par = stage.recipe.parallel
        entries: list[TimelineEntry] = []

        @contextmanager
        def around(step: Step):
            mb, imbalance = step.micro_batch, self.schedule[it][step.micro_batch]
            ledger.reset_peak()
            entry = TimelineEntry(it, mb, step.kind, max(imbalance.values()))
            entries.append(entry)
            before = static + ledger.live_device_bytes
            # the micro-batch's routing skew stays for its backward: a recompute routes as the forward did
            with ExitStack() as stack:
                for layer, x in imbalance.items():
                    fraction = skew_fraction(min(x, par.ep), par.ep)
                    stack.enter_context(RoutingSkew(self.adapter, fraction, par.ep, par.ep_rank, layers=[layer]))
                if step.kind == "F" and not adaptive:
                    ledger.micro_batch = mb
                    stack.enter_context(self.runner.forward())
                yield
            if step.kind == "F" and adaptive:
                event = self.runner.events[-1]  # what Algorithm 1 allowed, with what later warmup
                given = sum(d.overrun for d in event.deferred)  # micro-batches gave up
                entry.ceiling = before + event.budget + given
            entry.live, entry.peak = static + ledger.live_device_bytes, static + ledger.peak_device_bytes
            result.peak_device_bytes = max(result.peak_device_bytes, entry.peak)

        start = time.perf_counter()
        try:
            run_iteration(self.model, self.batches, stage.schedule, self.runner if adaptive else None, around=around)
        except SimulatedOutOfMemoryError as oom:
            self.optimizer.zero_grad(set_to_none=True)  # a restart resumes from the last step
            result.ooms += 1
            # the step that ran out (a forward: only forwards save); its peak is what it asked for
            entry = entries[-1]
            entry.oom, entry.live, entry.peak = True, static + oom.live_bytes, static + oom.live_bytes + oom.requested_bytes
            result.timeline += entries
            mean = sum(self._times) / len(self._times) if self._times else time.perf_counter() - start
            result.seconds += stage.recipe.spikes.restart_iterations * mean  # a cold restart
            self.close()
            self.current = "full_recompute"  # then the conservative policy
            return
        elapsed = time.perf_counter() - start
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        result.timeline += entries
        self._times.append(elapsed)
        result.seconds += elapsed
        result.steps_completed += 1
        result.tokens += stage.tokens * len(self.batches)

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
    stage = demo_stage(recipe, cost)
    schedule = imbalance_schedule(recipe.spikes, steps, recipe.pipeline.micro_batches, cost.moe_layers)
    generator = torch.Generator().manual_seed(seed)
    batch = recipe.batch
    batches = [
        torch.randint(0, recipe.model.vocab_size, (batch.micro_batch_size, batch.seq_len), generator=generator)
        for _ in range(recipe.pipeline.micro_batches)
    ]
    start = pretrained(stage, batches, seed)
    runs = [PolicyRun(p, stage, schedule, batches, start) for p in policies]
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
