"""The demo's policies and one policy's training run on a rank (paper §VI-C). Every policy runs
the same iterations on its own copy of the model, on every rank:

- adaptive: `bgl.apply` (per-micro-batch budgets, plans, gate-time escalation, §V-A);
- none: nothing mitigated (under-provisioned);
- full_recompute: every decoder layer recomputed (over-provisioned);
- static_average / static_worst: one per-op plan for all micro-batches, sized by Algorithm 2 for
  the normal band (AdaPipe-like) or for the largest spike;
- unbounded: nothing mitigated and no capacity (memory counted, never enforced): the fastest any
  policy can run this model, the limit the others are measured against;
- oracle: adaptive, but each micro-batch planned by Algorithm 2 for its real routing, known before
  its forward (a first pass records it, untimed: `Provisioner.routing`, `Provisioner.foresee`):
  the best the adaptive plans can be at this capacity.

An out-of-memory error on any rank stops the whole job, as on a cluster: every rank's Ledger
records its first overrun instead of raising (a rank that raised mid-forward would leave the
others blocked in its next all-to-all), and after every forward and backward all ranks learn
whether one ran out (`collectives.overrun_ranks`); if one did, every rank stops at that step. The
OOM counts once for the job, a restart costs `spikes.restart_iterations` times the mean iteration
time, and the job goes on under full recompute, as the paper treats its baselines. On a real
device (`hardware.simulated` false: one process, benchmarks/gpu_payoff.py) its allocator enforces
the capacity instead of the Ledger, and its own out-of-memory error restarts the job the same way.

An iteration's time is the slowest rank's, from a barrier at its start to the end of what its
device ran (a GPU is waited for at both ends); the training step after it (`model.train_step`)
is the same under every policy and not timed. The job's throughput is all
ranks' tokens over those times plus the charged restarts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..adapters import Adapter
from ..adapters.gate import RoutingSkew
from ..config import Telemetry
from ..costmodel import Forward
from ..costmodel.pipeline import Step
from ..costmodel.plan import Plan
from ..planner.decider import static_plan
from ..runtime.driver import run_iteration
from ..runtime.ledger import SimulatedOutOfMemoryError
from ..runtime.plan_runtime import PlanRuntime
from ..runtime.provisioner import Provisioner
from ..spikes import skew_fraction
from ..stage import Stage
from .collectives import max_over_ranks, overrun_ranks
from .model import LEARNING_RATE, rank_model, train_step

POLICIES = ("adaptive", "none", "full_recompute", "static_average", "static_worst", "unbounded", "oracle")
PLANNED = ("adaptive", "oracle")  # the policies a Provisioner runs


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
    missed_forwards: int = 0  # of `rank`'s latest forwards (`runtime.telemetry.EVENTS_KEPT`), those whose bytes the cost model missed
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


def _settle(device: torch.device) -> None:
    """Wait until a GPU has run the kernels queued on it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _static_plan(policy: str, stage: Stage) -> Plan:
    """A static policy's one plan: nothing, full recompute, or Algorithm 2 at Algorithm 1's first
    budget (the even share of the warmup stack) for the normal band or the largest spike."""
    if policy in ("none", "unbounded"):
        return Plan()
    recipe, cm = stage.recipe, stage.cost
    strategies = None if policy == "full_recompute" else recipe.strategies.allowed
    spikes = recipe.spikes
    imbalance = spikes.normal_max_imbalance if policy == "static_average" else spikes.spike_max_imbalance
    routed = stage.tokens * cm.pairs_per_token * imbalance
    return static_plan(cm, stage.budgets().budget(0), stage.tokens, recipe.batch.seq_len, routed, strategies, stage.options)


class PolicyRun:
    """One policy's model, optimizer, runtime and counters on this rank; `iteration(it)` runs one
    training iteration (every rank at once). `stage`: this rank's (its recipe's `parallel.ep_rank`
    is this rank); `hot`: the rank every micro-batch's routing skew targets; `start`: the weights
    its model starts from, the same for every policy. The model is made on the batches' device."""

    def __init__(self, policy: str, stage: Stage, schedule: list, batches: list, start: dict[str, torch.Tensor], hot: int):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.stage, self.schedule, self.batches, self.hot = stage, schedule, batches, hot
        self.model = rank_model(stage.recipe.model, device=batches[0].device)  # where its batches are
        self.model.load_state_dict(start)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)
        self.adapter = Adapter(self.model)
        self.size = dist.get_world_size()
        self.current, self.runner = policy, None
        self.result = PolicyResult(policy, 0, 0, 0.0, 0, 0, stage.capacity, rank=dist.get_rank())
        self._install()  # the Provisioner refuses a capacity that cannot hold M0, before any training

    def _install(self) -> None:
        if self.current in PLANNED:  # the demo draws its own timeline: no telemetry file per policy and restart
            recipe = self.stage.recipe.model_copy(update={"telemetry": Telemetry(enabled=False)})
            self.runner = Provisioner(self.model, recipe, self.stage.cost)
        else:  # the Ledger enforces a simulated capacity; a real device's allocator its own
            simulated = self.current != "unbounded" and self.stage.recipe.hardware.simulated
            capacity = self.stage.capacity if simulated else None
            self.runner = PlanRuntime(
                self.model, options=self.stage.options, capacity_bytes=capacity, static_bytes=self.stage.static_bytes
            ).install()
            self.runner.set_plan(_static_plan(self.current, self.stage))
        # an overrun stops every rank at the end of the step, not this one in the middle of a collective
        self.runner.ledger.on_overrun = "record"

    def iteration(self, it: int) -> None:
        """One iteration of pipeline rank `pipeline.rank`, then the optimizer step; an OOM on any
        rank drops the iteration's gradients on every rank and restarts with full recompute."""
        if self.runner is None:  # installed once; again only after a restart
            self._install()
        stage, result = self.stage, self.result
        adaptive, ledger, static = self.current in PLANNED, self.runner.ledger, stage.static_bytes
        entries: list[TimelineEntry] = []
        if self.current == "oracle":  # the first pass, before the iteration's clock starts
            for mb, ids in enumerate(self.batches):
                with self._skew(it, mb):
                    routed = self.runner.routing(self.model, input_ids=ids)
                self.runner.foresee(mb, Forward(ids.numel(), ids.shape[-1], routed))

        @contextmanager
        def around(step: Step):
            mb, imbalance = step.micro_batch, self.schedule[it][step.micro_batch]
            ledger.reset_peak(allocator=False)  # this step's, in the Ledger; a GPU allocator's peak is the caller's
            entry = TimelineEntry(it, mb, step.kind, max(imbalance.values()))
            entries.append(entry)
            before = static + ledger.live_device_bytes
            # the micro-batch's routing skew stays for its backward: a recompute routes as the forward did
            with ExitStack() as stack:
                stack.enter_context(self._skew(it, mb))
                if step.kind == "F" and not adaptive:
                    ledger.micro_batches.running = mb
                    stack.enter_context(self._forward())
                yield
            if step.kind == "F" and adaptive:
                event = self.runner.events[-1]  # what Algorithm 1 allowed, with what later warmup
                given = sum(d.overrun for d in event.deferred)  # micro-batches gave up
                entry.ceiling = before + event.budget + given
            entry.live, entry.peak = static + ledger.live_device_bytes, static + ledger.peak_device_bytes
            result.peak_device_bytes = max(result.peak_device_bytes, entry.peak)
            own = ledger.take_overrun()
            ranks = overrun_ranks(own is not None)  # every rank, after every step
            if ranks:
                entry.oom, entry.oom_ranks = True, tuple(ranks)
                raise JobOutOfMemoryError(ranks, own)

        dist.barrier()  # the iteration starts when every rank is there
        _settle(ledger.device)  # and its device has run what came before
        start = time.perf_counter()
        try:
            run_iteration(self.model, self.batches, stage.schedule, self.runner if adaptive else None, around=around)
        except torch.OutOfMemoryError:  # the job's, raised on every rank at the same step; or this device's own
            if entries and not entries[-1].oom:  # the device's allocator raised inside the step
                entries[-1].oom, entries[-1].oom_ranks = True, (dist.get_rank(),)
            self.optimizer.zero_grad(set_to_none=True)  # a restart resumes from the last step
            result.ooms += 1
            result.timeline += entries
            spent = max_over_ranks(time.perf_counter() - start)
            times = result.iteration_s
            mean = sum(times) / len(times) if times else spent
            charge = stage.recipe.spikes.restart_iterations * mean  # a cold restart
            result.restart_s += charge
            result.seconds += charge
            self.close()
            self.current = "full_recompute"  # then the conservative policy
            return
        _settle(ledger.device)
        elapsed = max_over_ranks(time.perf_counter() - start)  # the slowest rank's
        train_step(self.model, self.optimizer)
        result.timeline += entries
        result.iteration_s.append(elapsed)
        result.seconds += elapsed
        result.steps_completed += 1
        result.tokens += stage.tokens * len(self.batches) * self.size

    def _forward(self):
        """The context of a forward of a policy without plans: the Ledger counts what it saves."""
        return self.runner.forward()

    @contextmanager
    def _skew(self, it: int, mb: int):
        """Iteration `it`'s routing skew of micro-batch `mb` on the hot rank's experts, on every rank."""
        with ExitStack() as stack:
            for layer, x in self.schedule[it][mb].items():
                fraction = skew_fraction(min(x, self.size), self.size)
                stack.enter_context(RoutingSkew(self.adapter, fraction, self.size, self.hot, layers=[layer]))
            yield

    def close(self) -> PolicyResult:
        if isinstance(self.runner, Provisioner):
            self.result.forwards += self.runner.forwards
            self.result.planner_s += self.runner.planner_s
            self.result.missed_forwards += sum(bool(e.misses) for e in self.runner.events)
        if self.runner is not None:
            self.runner.remove()
            self.runner = None
        return self.result
