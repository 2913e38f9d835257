"""`bgl.apply(model, recipe)`: per-micro-batch control of activation memory (paper §V-A).

At each pipeline scheduling point the Provisioner gives the next forward micro-batch its budget
(Algorithm 1), plans per-operator mitigation for the routing it expects (Algorithm 2, cached),
and installs the plan. Right after each MoE gate the real local routed pairs are known and
`planner.at_gate` decides: they fit the slack; or, in warmup, the later warmup micro-batches give
the bytes up; or that layer's routed experts are recomputed as one unit before they run
(deferred planning). That is the strongest escalation left once the router has run (the paper
recomputes the whole MoE block), and it holds nothing per routed pair, the only bytes a spike
adds. After the forward the budget is replaced by what the Ledger counted. The engine
(`runtime.driver.run_iteration`, or nanotron's pipeline) calls `begin_forward`, `end_forward`,
`end_backward`.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..adapters import Adapter
from ..adapters.costs import model_cost
from ..adapters.gate import GateMonitor
from ..config import Recipe
from ..costmodel import CostModel
from ..costmodel.plan import Plan
from ..planner import CachedPlanner, GatePlan, LayerCost, escalated, gate_costs, plan_for_gates
from ..planner.dual_batch import ScheduleCache, executor_stages
from ..stage import Stage
from .ledger import Ledger
from .plan_runtime import PlanRuntime

EVENTS_KEPT = 4096  # events held in memory; the telemetry file has them all
INSTALLED_ATTR = "_bagualu_provisioner"  # on the HF model while a Provisioner is installed


@dataclass(frozen=True)
class Deferral:
    """A gate whose overrun the later warmup micro-batches' budgets absorb."""

    layer: int
    local_pairs: int
    overrun: float


@dataclass(frozen=True)
class Escalation:
    """A gate whose layer's routed experts are recomputed; `slack_after` is what is left then."""

    layer: int
    local_pairs: int
    overrun: float
    slack_after: float


@dataclass
class Event:
    """One forward micro-batch, as the telemetry file has it (one JSON object per line, these
    fields in this order). Complete once its backward has run."""

    micro_batch: int
    phase: str
    budget: int
    predicted: float
    plan: dict[str, str]
    escalations: list[Escalation]
    deferred: list[Deferral]
    tokens: int
    seq_len: int
    reload_bytes: float = 0.0  # room its backward needs to bring offloaded copies back, counted in its budget
    planner_s: float = 0.0
    actual: int | None = None  # set by end_forward
    peak_device_bytes: int | None = None  # static bytes plus the ledger's peak, at end_forward
    live_after_backward: int | None = None  # set by end_backward
    point: dict | None = None  # the fused scheduling point it began (runtime.dual_batch), if any
    routed: dict[int, int] = field(default_factory=dict)  # local routed pairs at each MoE layer's gate
    balanced_pairs: float = 0.0  # what balanced routing brings each MoE layer: `routed` / this is its imbalance

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class _Forward:
    """The micro-batch whose forward is running: made by `begin_forward`, closed by `end_forward`
    (as nanotron keeps one batch's buffers in its `PipelineTrainBatchState`)."""

    event: Event
    gates: GatePlan  # what each MoE layer's gate weighs
    slack: float  # bytes it may still add under its budget
    headroom: float  # bytes later warmup micro-batches can still give up
    hooks: ExitStack  # the plan's hooks and the gate monitor, entered


def _check_expert_group(adapter: Adapter, recipe: Recipe) -> None:
    """The recipe's expert parallelism is the model's: the cost model, the planned pairs and the
    gate's local pairs all follow the group the routed experts are sharded over."""
    group, par = adapter.expert_group, recipe.parallel
    size, rank = (group.size, group.rank) if group is not None else (1, 0)
    if (par.ep, par.ep_rank) != (size, rank):
        where = f"expert-parallel over {size} ranks and this is rank {rank}" if group else "not expert-parallel"
        hint = "set them to the group's" if group else "shard its experts first with bgl.expert_parallel(model, group)"
        raise ValueError(f"recipe parallel.ep={par.ep}, parallel.ep_rank={par.ep_rank}, but the model is {where}: {hint}")


def _check_recompute_owner(adapter: Adapter) -> None:
    """Per-operator recompute is ours: HF's gradient checkpointing or a checkpoint wrapper (what
    accelerate's `fsdp_activation_checkpointing` and torch's `apply_activation_checkpointing`
    install) would recompute the same layers a second time, under their own rules."""
    model = adapter.model
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    if getattr(model, flag, False):
        raise ValueError(
            "the model has HF gradient checkpointing enabled (gradient_checkpointing_enable() or "
            "activation_checkpointing_enable()) and bgl.apply plans recompute per operator: disable it "
            "(gradient_checkpointing_disable())"
        )
    wrapped = [name for name, module in model.named_modules() if type(module).__name__ == "CheckpointWrapper"]
    if wrapped:
        raise ValueError(
            f"modules {wrapped[:3]}{' ...' if len(wrapped) > 3 else ''} are wrapped for activation checkpointing "
            "(accelerate's fsdp_activation_checkpointing, or torch's apply_activation_checkpointing) and bgl.apply plans "
            "recompute per operator: turn fsdp_activation_checkpointing off"
        )


class Provisioner:
    def __init__(self, model: nn.Module, recipe: Recipe, cost: CostModel | None = None):
        """`model` is this pipeline rank's stage; `cost` its cost model (default: the analytic one
        of the model's config)."""
        self.recipe = recipe
        adapter = Adapter(model)
        if getattr(adapter.model, INSTALLED_ATTR, None) is not None:
            raise ValueError("bgl.apply: this model has a Provisioner installed already; call .remove() on it first")
        _check_recompute_owner(adapter)
        _check_expert_group(adapter, recipe)
        self.stage = Stage.of(recipe, cost or model_cost(model, recipe.hardware), split=False)
        stage = self.stage
        self._first = stage.budgets()
        self.budgets = self._first
        # the schedule's phase of each forward: 1F1B's steady phase starts one forward before
        # Algorithm 1's does (that forward also runs before any backward, so it is budgeted as warmup)
        self.phases = {s.micro_batch: s.phase for s in stage.schedule if s.kind == "F"}
        balanced = stage.tokens * stage.cost.pairs_per_token
        self.planner = CachedPlanner(  # cache buckets: 1/16 of M0 and of the balanced routing
            stage.cost,
            budget_quantum=max(1, stage.min_budget // 16),
            routed_quantum=max(1, int(balanced) // 16),
            strategies=recipe.strategies.allowed,
            options=stage.options,
        )
        self.schedules = ScheduleCache(executor_stages(stage.chunks, stage.options))  # fused points' orders (runtime.dual_batch)
        self.runtime = PlanRuntime(
            model,
            options=stage.options,
            capacity_bytes=stage.capacity if recipe.hardware.simulated else None,
            static_bytes=stage.static_bytes,
        ).install()
        self.gate = GateMonitor(self.runtime.adapter, on_gate=self._on_gate)  # installed while a forward runs
        self.telemetry = Path(recipe.telemetry.path) if recipe.telemetry.path else None
        # the latest micro-batches' events (a long run would otherwise grow without bound) and
        # running totals over all of them
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self.forwards, self.planner_s = 0, 0.0
        self._awaiting_backward: dict[int, Event] = {}
        self._plans: dict[int, Plan] = {}  # the plan each awaiting micro-batch ran, escalations included
        self._forward: _Forward | None = None
        self._layer_costs: dict[tuple, dict[int, LayerCost]] = {}
        self._accumulated = 0  # micro_batch(): micro-batches of the current optimizer step so far
        setattr(adapter.model, INSTALLED_ATTR, self)

    @property
    def ledger(self) -> Ledger:
        return self.runtime.ledger

    def begin_forward(
        self, mb: int, tokens: int, seq_len: int, *, phase: str | None = None, in_flight: int | None = None
    ) -> None:
        """Budget and plan micro-batch `mb` of `tokens` tokens for the normal routing band; its
        saved tensors go through the plan until `end_forward`. An engine that knows the schedule
        passes `phase` ("warmup" or "steady") and `in_flight` (micro-batches awaiting backward,
        nanotron's `len(state.microbatches_activations_requiring_backward)`): they are checked
        against Algorithm 1's state, whose budgets are wrong if the two disagree."""
        start = time.perf_counter()
        if self._forward is not None:
            raise ValueError(f"begin_forward({mb}): the forward of micro-batch {self._forward.event.micro_batch} has not ended")
        if mb == 0:  # a new iteration: Algorithm 1 starts over, with nothing left of the last one
            _check_recompute_owner(self.runtime.adapter)  # enabled or wrapped after bgl.apply
            if self._awaiting_backward:
                raise ValueError(
                    f"begin_forward(0): micro-batches {sorted(self._awaiting_backward)} of the last iteration await end_backward"
                )
            self.budgets = self._first
        pipe = self.recipe.pipeline
        scheduled = self.phases.get(mb, "steady")
        for name, given, wanted in (("phase", phase, scheduled), ("in_flight", in_flight, len(self._awaiting_backward))):
            if given is not None and given != wanted:
                raise ValueError(
                    f"begin_forward({mb}): the engine says {name}={given!r}, but pipeline rank {pipe.rank} of "
                    f"pp {pipe.pp} running 1F1B expects {wanted!r}: check the recipe's pipeline section against "
                    "the engine, and that end_backward is called"
                )
        budget = self.budgets.budget(mb)
        # plan for the common case (97.1% of iterations stay under normal_max_imbalance, §II-B),
        # leaving each gate what it needs to catch routing up to spike_max_imbalance
        pairs = tokens * self.stage.cost.pairs_per_token
        spikes = self.recipe.spikes
        planned = pairs * spikes.normal_max_imbalance
        routed = [planned] * len(self.stage.cost.moe_layers)
        gates = plan_for_gates(
            lambda b: self.planner.plan(b, tokens, routed, seq_len), lambda plan: self._gate_costs(plan, tokens, seq_len, planned),
            budget, planned, pairs * spikes.spike_max_imbalance,
        )
        decision = gates.decision
        if gates.slack < 0:
            warnings.warn(
                f"micro-batch {mb}: its budget of {budget} bytes is below what any plan keeps at the normal band's routing "
                f"({decision.activation_bytes + decision.reload_bytes:.0f} bytes): it runs the most mitigated plan, which "
                "fits only lighter routing; raise the capacity or the pipeline degree, or shorten the micro-batch",
                RuntimeWarning, stacklevel=2,
            )
        self.runtime.set_plan(decision.plan)
        plan = {str(op): s for op, s in sorted(decision.plan.items())}
        event = Event(mb, scheduled, budget, decision.activation_bytes, plan, [], [], tokens, seq_len, decision.reload_bytes)
        event.balanced_pairs = pairs
        self.ledger.micro_batch = mb
        hooks = ExitStack()
        hooks.enter_context(self.runtime.forward())
        hooks.enter_context(self.gate)
        self._forward = _Forward(event, gates, gates.slack, self.budgets.headroom(mb), hooks)
        event.planner_s = time.perf_counter() - start

    def _gate_costs(self, plan: Plan, tokens: int, seq_len: int, planned: float) -> dict[int, LayerCost]:
        key = (tuple(sorted(plan.items())), tokens, seq_len)
        if key not in self._layer_costs:  # as few as the planner's cached decisions
            self._layer_costs[key] = gate_costs(self.stage.cost, plan, tokens, seq_len, planned, self.stage.options)
        return self._layer_costs[key]

    def _on_gate(self, layer: int, tokens_per_expert: torch.Tensor, local_pairs: torch.Tensor) -> None:
        """Deferred planning: the experts of `layer` have not run yet (`planner.at_gate`)."""
        f = self._forward
        if f is None or layer not in f.gates.costs:
            return
        pairs = int(local_pairs)  # one host sync per MoE layer
        f.event.routed[layer] = pairs
        decision = f.gates.at_gate(layer, pairs, f.slack, f.headroom)
        f.slack, f.headroom = decision.slack, decision.headroom
        if decision.action == "defer":
            f.event.deferred.append(Deferral(layer, pairs, decision.overrun))
        elif decision.action == "escalate":
            self.runtime.set_plan(escalated(self.runtime.plan, layer))
            f.event.escalations.append(Escalation(layer, pairs, decision.overrun, decision.slack))

    def end_forward(self, mb: int) -> int:
        """The bytes micro-batch `mb` really keeps; its budget becomes that, with the room its
        backward needs to bring offloaded copies back (Algorithm 1; the Ledger counts restored
        copies on the device, as the allocator does)."""
        f = self._forward
        if f is None or f.event.micro_batch != mb:
            raise ValueError(f"end_forward({mb}): no forward of micro-batch {mb} is running")
        f.hooks.close()
        self._forward = None
        actual = self.ledger.by_micro_batch().get(mb, 0)
        self.budgets = self.budgets.after_forward(mb, actual + round(f.event.reload_bytes))
        f.event.actual = actual
        f.event.peak_device_bytes = self.ledger.peak_device_bytes + self.stage.static_bytes
        self.events.append(f.event)
        self.forwards += 1
        self.planner_s += f.event.planner_s
        self._awaiting_backward[mb] = f.event
        self._plans[mb] = self.runtime.plan
        return actual

    def event_of(self, mb: int) -> Event:
        """The event of micro-batch `mb`, whose forward runs or awaits its backward."""
        if self._forward is not None and self._forward.event.micro_batch == mb:
            return self._forward.event
        if mb not in self._awaiting_backward:
            raise ValueError(f"micro-batch {mb} has no forward running or awaiting its backward")
        return self._awaiting_backward[mb]

    def plan_of(self, mb: int) -> Plan:
        """The plan micro-batch `mb` runs (its forward is running) or ran (it awaits its backward)."""
        self.event_of(mb)
        return self._plans.get(mb, self.runtime.plan)

    def record_point(self, mb: int, point: dict) -> None:
        """The fused scheduling point that began with micro-batch `mb`'s forward, for its event."""
        self.event_of(mb).point = point

    def end_backward(self, mb: int) -> int:
        """Micro-batch `mb`'s activations are released; returns what the stage still keeps (the
        memory Algorithm 1 hands to the next forward), recorded in `mb`'s event, which is then
        complete and written to the telemetry file."""
        live = self.ledger.live_device_bytes
        event = self._awaiting_backward.pop(mb, None)
        self._plans.pop(mb, None)
        if event is None:
            raise ValueError(f"end_backward({mb}): micro-batch {mb} has no finished forward awaiting its backward")
        event.live_after_backward = live
        if self.telemetry:
            with self.telemetry.open("a") as f:
                f.write(event.to_json() + "\n")
        return live

    @contextmanager
    def micro_batch(self, input_ids: torch.Tensor) -> Iterator[int]:
        """One micro-batch of a loop without pipeline parallelism (gradient accumulation under
        Accelerate, DDP, FSDP or plain torch; the recipe's pp is 1): run its forward and its
        backward inside the block. The micro-batches of one optimizer step are counted
        (`pipeline.micro_batches` of them, yielded as 0, 1, ...); the forward ends where the HF
        model's forward returns, so the backward in the block runs under no plan's hooks."""
        pipe = self.recipe.pipeline
        if pipe.pp != 1:
            raise ValueError(f"micro_batch() runs without pipeline parallelism, but the recipe has pipeline.pp={pipe.pp}")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"micro_batch(input_ids): expected the (batch, sequence) token ids, got {input_ids!r:.80}")
        mb = self._accumulated
        self.begin_forward(mb, input_ids.numel(), input_ids.shape[-1])
        forwards = []

        def ended(*_):
            if forwards:
                raise ValueError(f"micro_batch({mb}): the model ran a second forward inside one micro-batch")
            forwards.append(self.end_forward(mb))

        hook = self.runtime.adapter.model.register_forward_hook(ended)
        try:
            yield mb
        except BaseException:
            self._abandon()
            raise
        finally:
            hook.remove()
        if not forwards:
            self._abandon()
            raise ValueError(f"micro_batch({mb}): the model ran no forward inside the block")
        self.end_backward(mb)
        self._accumulated = (mb + 1) % pipe.micro_batches

    def _abandon(self) -> None:
        """A micro_batch block failed: the optimizer step's accounting is dropped (its forward's
        hooks closed, nothing awaits a backward), and the next micro-batch starts a new step."""
        if self._forward is not None:
            self._forward.hooks.close()
            self._forward = None
        self._awaiting_backward.clear()
        self._plans.clear()
        self._accumulated = 0

    def remove(self) -> None:
        self.gate.remove()
        self.runtime.remove()
        if getattr(self.runtime.adapter.model, INSTALLED_ATTR, None) is self:
            delattr(self.runtime.adapter.model, INSTALLED_ATTR)


def apply(model: nn.Module, recipe: Recipe, cost: CostModel | None = None) -> Provisioner:
    """`bgl.apply`: install adaptive activation provisioning on `model` as `recipe` says."""
    return Provisioner(model, recipe, cost)
