"""The spike demo: adaptive provisioning against static policies on one real model (paper §II-B,
§VI-C), on CPU with a simulated device capacity (DESIGN.md section 6).

A tiny GLM-4-MoE trains under real expert parallelism: `parallel.ep` processes in one gloo group
(`parallel.launch.run_ranks`), each rank holding its share of the routed experts
(`bgl.expert_parallel`), running its own batches and exchanging routed rows with the others by
all-to-all in every MoE layer's forward and backward. Each rank also runs as pipeline rank
`pipeline.rank` of a 1F1B pipeline (one process per EP rank: the pipeline's other stages are not
run). Routing follows the recipe's spikes (97.1% of iterations under 1.2x, 2.9% up to 2.6x by
default, or as configured): every rank moves the same fraction of its pairs onto the experts of
rank `parallel.ep_rank`, the hot rank, whose memory the demo reports. Every policy runs the same
iterations on its own copy of the model, on every rank:

- adaptive: `bgl.apply` (per-micro-batch budgets, plans, gate-time escalation) on every rank;
- none: nothing mitigated (under-provisioned);
- full_recompute: every decoder layer recomputed (over-provisioned);
- static_average / static_worst: one per-op plan for all micro-batches, sized by Algorithm 2 for
  the normal band (AdaPipe-like) or for the largest spike.

An out-of-memory error on any rank stops the whole job, as on a cluster: every rank's Ledger
records its first overrun instead of raising (`Ledger(on_overrun="record")`: a rank that raised
mid-forward would leave the others blocked in its next all-to-all), and after every forward and
backward all ranks all-reduce whether one ran out; if one did, every rank stops at that same step.
The OOM is counted once for the job, a restart costs `spikes.restart_iterations` times the mean
iteration time, and the job continues with full recompute on every rank, as the paper treats its
baselines. Policies take turns iteration by iteration, so a slow spell of a shared machine costs
them all alike and the throughput ratios of one run can be trusted.

Every iteration runs through the one 1F1B driver (`runtime.driver.run_iteration`) and ends with
the replicated parameters' gradients averaged over the ranks (data parallelism, dp = ep) and an
AdamW step, the same for every policy, so the router trains and routing evolves as in training.
Neither is timed: they are the same work under every policy, and the throughput compares what
the policies change. An iteration's time is the slowest rank's (all-reduce MAX of each rank's
time, from a barrier at its start); the job's throughput is all ranks' tokens over the sum of
those times and the charged restarts. Every policy starts from the same weights, a few steps into
training (`pretrained`).
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .adapters import Adapter, tiny_model
from .adapters.gate import RoutingSkew
from .config import Recipe
from .costmodel import CostModel, ModelDims
from .costmodel.pipeline import Step
from .costmodel.plan import Plan
from .parallel.expert import expert_parallel
from .parallel.launch import run_ranks
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
THREADS_PER_RANK = 1  # the ranks share the machine's cores: one torch thread each


@dataclass
class TimelineEntry:
    """One forward or backward of a policy's iteration on one rank; bytes include the static bytes."""

    iteration: int
    micro_batch: int
    kind: str  # "F" or "B"
    spike: float  # the micro-batch's largest imbalance
    live: int = 0  # after the step
    peak: int = 0  # the step's peak; for a step that overran, what it needed (it ran to its end)
    ceiling: int | None = None  # adaptive forwards: the bytes before it plus its budget (Algorithm 1)
    oom: bool = False  # the job ran out of memory at this step (on `oom_ranks`) and restarted
    oom_ranks: tuple[int, ...] = ()


@dataclass
class PolicyResult:
    """One policy over the job: memory of one rank (`rank`, the hot rank in `run_demo`), time
    and tokens of the whole job."""

    policy: str
    steps_completed: int
    ooms: int  # of the job: an OOM on any rank stops every rank and counts once
    seconds: float  # the job's compute time (each iteration the slowest rank's) plus charged restarts
    tokens: int  # every rank's
    peak_device_bytes: int  # static bytes plus the activation peak, on `rank`
    capacity_bytes: int
    forwards: int = 0  # `rank`'s
    planner_s: float = 0.0  # `rank`'s
    timeline: list[TimelineEntry] = field(default_factory=list)  # `rank`'s
    iteration_s: list[float] = field(default_factory=list)  # the job's completed iterations, each the slowest rank's
    restart_s: float = 0.0  # charged for restarts after OOMs (in `seconds`)
    rank: int = 0
    rank_peak_device_bytes: list[int] = field(default_factory=list)  # every rank's peak, in rank order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def planner_ms_per_micro_batch(self) -> float:
        return self.planner_s * 1e3 / self.forwards if self.forwards else 0.0


class JobOutOfMemoryError(torch.OutOfMemoryError):
    """Raised on every rank at the same step when any rank's simulated memory overran in it (the
    job stops, as on a cluster). `ranks`: those that overran; `own`: this rank's overrun (None if
    it had room)."""

    def __init__(self, ranks: Sequence[int], own: SimulatedOutOfMemoryError | None):
        self.ranks, self.own = tuple(ranks), own
        super().__init__(f"simulated out of memory on expert-parallel ranks {list(self.ranks)}" + (f": {own}" if own else ""))


def demo_model(dims: ModelDims, seed: int = 0):
    """A random-init GLM-4-MoE with the recipe's dimensions (tiny by design), running the
    "bagualu" experts implementation (what `expert_parallel` needs)."""
    model = tiny_model(
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
    model.set_experts_implementation("bagualu")
    return model


def rank_model(dims: ModelDims, seed: int = 0):
    """This rank's demo model: the seeded model (the same on every rank), its routed experts
    sharded over the world group."""
    model = demo_model(dims, seed)
    expert_parallel(model)
    return model


def rank_recipe(recipe: Recipe, rank: int) -> Recipe:
    """`recipe` as rank `rank` of its expert-parallel group runs it (`parallel.ep_rank`, which
    `bgl.apply` checks against the group)."""
    return recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"ep_rank": rank})})


def demo_cost(recipe: Recipe, seed: int = 0) -> CostModel:
    """This rank's cost model, profiled on its model by every rank at once (`bgl.profile` under
    expert parallelism), so the bytes it predicts at the rank's local routed pairs are exact."""
    tokens = recipe.batch.tokens
    return profile(rank_model(recipe.model, seed), [tokens // 4, tokens // 2, tokens], repeats=1)


def demo_stage(recipe: Recipe, cost: CostModel) -> Stage:
    """The pipeline stage the demo model is: the whole model, its cost model profiled."""
    if recipe.budget.non_activation_bytes == "auto":
        raise ValueError("the demo needs budget.non_activation_bytes as a number (its model's weights are not on the simulated device)")
    return Stage.of(recipe, cost, split=False)


def check_capacity(stage: Stage) -> None:
    """Raise ValueError, naming M0, when the capacity cannot hold the static bytes plus the
    in-flight micro-batches under full recompute: then no policy can run (Algorithm 1's check)."""
    stage.budgets()


def average_gradients(model: torch.nn.Module) -> None:
    """Data parallelism over the expert-parallel group (the recipe's dp = ep): the replicated
    parameters' gradients are averaged over the ranks, so their weights stay equal on every
    rank; a local expert's gradient already sums every rank's tokens routed to it, so it is
    divided by the ranks likewise (the gradient of the mean of the ranks' losses)."""
    size = dist.get_world_size()
    experts = {id(p) for layer in Adapter(model).layers if layer.moe for p in layer.experts.parameters()}
    replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in replicated])
    dist.all_reduce(flat)
    flat /= size
    offset = 0
    for p in replicated:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    for p in model.parameters():
        if id(p) in experts and p.grad is not None:
            p.grad /= size


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    average_gradients(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def pretrained(stage: Stage, batches: Sequence[torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """This rank's weights every policy starts from: the seeded model after `PRETRAIN_STEPS`
    steps of plain training on every rank's batches (every rank at once). The random-init router
    routes unevenly (measured: rank 0 receives 1.11x its balanced share in the first iteration)
    and the first steps of training take most of that away (within 5% after them); starting past
    them, the memory the policies meet follows the spike schedule, as in the paper."""
    model = rank_model(stage.recipe.model, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for _ in range(PRETRAIN_STEPS):
        run_iteration(model, batches, stage.schedule)
        _train_step(model, optimizer)
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


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _overrun_ranks(overran: bool) -> list[int]:
    """Every rank learns which ranks overran (one all-reduce): the collective OOM check."""
    flags = torch.zeros(dist.get_world_size())
    flags[dist.get_rank()] = float(overran)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [r for r, f in enumerate(flags.tolist()) if f]


class PolicyRun:
    """One policy's model, optimizer, runtime and counters on this rank; `iteration(it)` runs one
    training iteration (every rank at once). `stage`: this rank's (its recipe's `parallel.ep_rank`
    is this rank); `hot`: the rank every micro-batch's routing skew targets; `start`: the weights
    its model starts from, the same for every policy."""

    def __init__(self, policy: str, stage: Stage, schedule: list, batches: list, start: dict[str, torch.Tensor], hot: int):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.stage, self.schedule, self.batches, self.hot = stage, schedule, batches, hot
        self.model = rank_model(stage.recipe.model)
        self.model.load_state_dict(start)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)
        self.adapter = Adapter(self.model)
        self.size = dist.get_world_size()
        self.current, self.runner = policy, None
        self.result = PolicyResult(policy, 0, 0, 0.0, 0, 0, stage.capacity, rank=dist.get_rank())
        self._install()  # the Provisioner refuses a capacity that cannot hold M0, before any training

    def _install(self) -> None:
        if self.current == "adaptive":
            self.runner = Provisioner(self.model, self.stage.recipe, self.stage.cost)
        else:
            self.runner = PlanRuntime(self.model, capacity_bytes=self.stage.capacity, static_bytes=self.stage.static_bytes).install()
            self.runner.set_plan(_static_plan(self.current, self.stage))
        # an overrun stops every rank at the end of the step, not this one in the middle of a collective
        self.runner.ledger.on_overrun = "record"

    def iteration(self, it: int) -> None:
        """One iteration of pipeline rank `pipeline.rank`, then the optimizer step; an OOM on any
        rank drops the iteration's gradients on every rank and restarts with full recompute."""
        if self.runner is None:  # installed once; again only after a restart
            self._install()
        stage, result = self.stage, self.result
        adaptive, ledger, static = self.current == "adaptive", self.runner.ledger, stage.static_bytes
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
                    fraction = skew_fraction(min(x, self.size), self.size)
                    stack.enter_context(RoutingSkew(self.adapter, fraction, self.size, self.hot, layers=[layer]))
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
            own = ledger.take_overrun()
            ranks = _overrun_ranks(own is not None)  # every rank, after every step
            if ranks:
                entry.oom, entry.oom_ranks = True, tuple(ranks)
                raise JobOutOfMemoryError(ranks, own)

        dist.barrier()  # the iteration starts when every rank is there
        start = time.perf_counter()
        try:
            run_iteration(self.model, self.batches, stage.schedule, self.runner if adaptive else None, around=around)
        except JobOutOfMemoryError:  # raised on every rank at the same step
            self.optimizer.zero_grad(set_to_none=True)  # a restart resumes from the last step
            result.ooms += 1
            result.timeline += entries
            spent = _max_over_ranks(time.perf_counter() - start)
            times = result.iteration_s
            mean = sum(times) / len(times) if times else spent
            charge = stage.recipe.spikes.restart_iterations * mean  # a cold restart
            result.restart_s += charge
            result.seconds += charge
            self.close()
            self.current = "full_recompute"  # then the conservative policy
            return
        elapsed = _max_over_ranks(time.perf_counter() - start)  # the slowest rank's
        _train_step(self.model, self.optimizer)
        result.timeline += entries
        result.iteration_s.append(elapsed)
        result.seconds += elapsed
        result.steps_completed += 1
        result.tokens += stage.tokens * len(self.batches) * self.size

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


def rank_batches(recipe: Recipe, rank: int, seed: int = 0) -> list[torch.Tensor]:
    """Rank `rank`'s micro-batches of token ids (its own, seeded by `seed` and the rank)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    batch = recipe.batch
    return [
        torch.randint(0, recipe.model.vocab_size, (batch.micro_batch_size, batch.seq_len), generator=generator)
        for _ in range(recipe.pipeline.micro_batches)
    ]


@dataclass(frozen=True)
class SetupError:
    """A rank's setup failed (e.g. a capacity that cannot hold M0); every rank returns it."""

    message: str


def _agree(error: str | None) -> str | None:
    """Every rank learns whether any rank failed (the first one's message), so that no rank goes
    on into a collective that the failed one never joins."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def demo_rank(
    rank: int, size: int, recipe: Recipe, steps: int, policies: Sequence[str], seed: int = 0, progress=None
) -> list[PolicyResult] | SetupError:
    """The demo on expert-parallel rank `rank` of `size` (a `run_ranks` worker): profile, pretrain,
    then `steps` iterations of every policy, taking turns, all in the same order as every other
    rank. `progress`: a queue the hot rank puts 1 on after every policy iteration."""
    _caching_host_allocator()
    hot = recipe.parallel.ep_rank
    mine = rank_recipe(recipe, rank)
    cost = demo_cost(mine, seed)
    stage = demo_stage(mine, cost)
    try:
        check_capacity(stage)  # before any training
    except ValueError as exc:
        error = str(exc)
    else:
        error = None
    if (error := _agree(error)) is not None:
        return SetupError(error)
    schedule = imbalance_schedule(recipe.spikes, steps, recipe.pipeline.micro_batches, cost.moe_layers)
    batches = rank_batches(recipe, rank, seed)
    start = pretrained(stage, batches, seed)
    runs, error = [], None
    try:
        runs = [PolicyRun(p, stage, schedule, batches, start, hot) for p in policies]
    except ValueError as exc:
        error = str(exc)
    if (error := _agree(error)) is not None:
        for run in runs:
            run.close()
        return SetupError(error)
    # What exists now (models, cost model, torch and HF modules) lives to the end: freeze it out
    # of the collector, as long training loops do, or each full collection walks it all (0.2 s
    # here, at random iterations of random policies)
    gc.freeze()
    try:
        for it in range(steps):
            for run in runs:
                run.iteration(it)
                if progress is not None and rank == hot:
                    progress.put(1)
    finally:
        gc.unfreeze()
        results = [run.close() for run in runs]
    return results


def run_demo(
    recipe: Recipe,
    steps: int,
    policies: Sequence[str] = POLICIES,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    timeout_s: float | None = None,
) -> list[PolicyResult]:
    """`steps` iterations of every policy on `recipe.parallel.ep` expert-parallel ranks, each its
    own process (`demo_rank`); returns, per policy, the hot rank's (`parallel.ep_rank`) memory
    with the job's OOMs, time and tokens, and every rank's peak. `progress(n)` is called (from a
    thread of this process) after every policy iteration. `timeout_s`: the job's deadline and
    the collectives' timeout (default: generous for the demo's size)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"policies must be a non-empty subset of {POLICIES}, got {list(policies)}")
    ep = recipe.parallel.ep
    if ep < 2 or recipe.model.num_experts % ep:
        raise ValueError(f"the demo needs parallel.ep >= 2 dividing model.num_experts={recipe.model.num_experts}, got {ep}")
    # before starting any process: a capacity that cannot hold M0 by the analytic cost model
    # (each rank checks again with its profiled one)
    check_capacity(demo_stage(recipe, CostModel.from_config(recipe.model, recipe.hardware, recipe.parallel)))
    timeout_s = timeout_s or 120 + 10 * steps * len(policies)
    queue, pump = None, None
    if progress is not None:
        queue = torch.multiprocessing.get_context("spawn").SimpleQueue()
        pump = threading.Thread(target=_pump, args=(queue, progress), daemon=True)
        pump.start()
    try:
        ranks = run_ranks(demo_rank, ep, recipe, steps, list(policies), seed, queue, timeout_s=timeout_s, threads=THREADS_PER_RANK)
    finally:
        if queue is not None:
            queue.put(None)
            pump.join(timeout=10)
    failed = next((r for r in ranks if isinstance(r, SetupError)), None)
    if failed is not None:
        raise ValueError(failed.message)
    hot = ranks[recipe.parallel.ep_rank]
    for i, result in enumerate(hot):
        result.rank_peak_device_bytes = [r[i].peak_device_bytes for r in ranks]
    return hot


def _pump(queue, progress: Callable[[int], None]) -> None:
    while (n := queue.get()) is not None:
        progress(n)


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
            "rank": r.rank,
            "rank_peak_device_bytes": r.rank_peak_device_bytes,
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
