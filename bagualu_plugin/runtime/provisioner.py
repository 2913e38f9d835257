"""`bgl.apply(model, recipe)`: per-micro-batch control of activation memory (paper §V-A).

At each pipeline scheduling point the Provisioner gives the next forward micro-batch its budget
(Algorithm 1), plans per-operator mitigation for the routing it expects (Algorithm 2, cached),
and installs the plan. Right after each MoE gate the real local routed pairs are known and
`planner.at_gate` decides: they fit the slack; or, in warmup, the later warmup micro-batches give
the bytes up; or that layer's routed experts are recomputed as one unit before they run
(deferred planning). In one process that holds nothing per routed pair, the only bytes a spike
adds. Under expert parallelism it still holds the rows dispatch received; where that does not
fit, the ranks of the group agree at the gate (`parallel.expert.any_rank`) and recompute the
layer's experts with their all-to-alls on every rank (the collective escalation, the floor: the
paper recomputes the whole MoE block). After the forward the budget is replaced by what the
Ledger counted. A save that would still go past the capacity (a forward keeping more than its
cost model said, after its last gate) first moves activations kept earlier to host memory
(`Ledger.spill_at`). Where an engine gathers the weights module by module over several
processes (ZeRO-3, FSDP), the ranks recompute in lockstep (`parallel.lockstep`). The engine
(`runtime.driver.run_iteration`, or nanotron's pipeline) calls `begin_forward`, `end_forward`,
`end_backward`.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..adapters import Adapter
from ..adapters.costs import DTYPES, model_cost
from ..adapters.gate import GateMonitor
from ..config import Batch, Budget, Recipe
from ..costmodel import CostModel, Forward, ForwardKind
from ..costmodel.graph import COLLECTIVE_OPS, OpId
from ..derive import derive_recipe
from ..parallel.expert import any_rank, expert_group
from ..parallel.lockstep import lockstep_group, recomputed_anywhere
from ..planner.decider import Decider, Decisions
from ..planner.gate import GatePlan, escalated_block
from ..stage import Stage, mitigation_options
from ..units import fmt_bytes
from .boundaries import Boundaries
from .calibration import Calibration, Expected, gate_pairs
from .ledger import Ledger, SimulatedOutOfMemoryError, _storage
from .micro_batches import MicroBatches
from .plan_runtime import PlanRuntime
from .static_memory import StaticMemory
from .telemetry import Event, EventLog

INSTALLED_ATTR = "_bagualu_provisioner"  # on the HF model while a Provisioner is installed


_COLLECTIVE = frozenset(COLLECTIVE_OPS)


@dataclass
class _Running:
    """The micro-batch whose forward is running: made by `begin_forward`, closed by `end_forward`
    (as nanotron keeps one batch's buffers in its `PipelineTrainBatchState`)."""

    event: Event
    decided: Decisions  # its budget, plan and gates (`planner.decider`)
    hooks: ExitStack  # the plan's hooks entered and the gate monitor on, until the forward ends
    forward: Forward  # what it is: its shape and kind (its routing known at its gates)
    expected: Expected  # what its blocks should keep, as its gates come
    spilled_before: int  # the Ledger's `spilled_bytes` as it began: what its forward moves is the difference
    beyond: float = 0.0  # what its layers before the latest gate kept beyond that, taken from its slack
    ran: dict[int, set[str]] = field(default_factory=dict)  # the ops its forward has entered so far, by layer


def _check_expert_group(adapter: Adapter, recipe: Recipe) -> None:
    """The recipe's expert parallelism is the model's: the cost model, the planned pairs and the
    gate's local pairs all follow the group the routed experts are sharded over."""
    group, par = adapter.expert_group, recipe.parallel
    size, rank = (group.size, group.rank) if group is not None else (1, 0)
    if (par.ep, par.ep_rank) != (size, rank):
        where = f"expert-parallel over {size} ranks and this is rank {rank}" if group else "not expert-parallel"
        hint = "set them to the group's" if group else "shard its experts first with bgl.expert_parallel(model, group)"
        raise ValueError(f"recipe parallel.ep={par.ep}, parallel.ep_rank={par.ep_rank}, but the model is {where}: {hint}")


class _RecomputeOwner:
    """Per-operator recompute is ours: HF's gradient checkpointing (a `gradient_checkpointing`
    flag on the modules that carry one, what `is_activation_checkpointing` reads) or a checkpoint
    wrapper (what accelerate's `fsdp_activation_checkpointing` and torch's
    `apply_activation_checkpointing` install) would recompute the same layers a second time,
    under their own rules. `check` runs at build and at each iteration's first micro-batch
    (enabled or wrapped after bgl.apply); it walks the modules only when they changed (a wrapper
    is a registration: the Ledger's walk sees it), else it reads the few flags."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._tree: frozenset[nn.Module] | None = None
        self._flagged: tuple[nn.Module, ...] = ()

    def check(self, modules: frozenset[nn.Module]) -> None:
        if modules is not self._tree:
            wrapped = [name for name, module in self.model.named_modules() if type(module).__name__ == "CheckpointWrapper"]
            if wrapped:
                raise ValueError(
                    f"modules {wrapped[:3]}{' ...' if len(wrapped) > 3 else ''} are wrapped for activation checkpointing "
                    "(accelerate's fsdp_activation_checkpointing, or torch's apply_activation_checkpointing) and bgl.apply "
                    "plans recompute per operator: turn fsdp_activation_checkpointing off"
                )
            self._flagged = tuple(m for m in modules if hasattr(m, "gradient_checkpointing"))
            self._tree = modules
        if any(m.gradient_checkpointing for m in self._flagged):
            raise ValueError(
                "the model has HF gradient checkpointing enabled (gradient_checkpointing_enable() or "
                "activation_checkpointing_enable()) and bgl.apply plans recompute per operator: disable it "
                "(gradient_checkpointing_disable())"
            )


def _simulated_capacity(recipe: Recipe) -> int | None:
    """The device capacity the Ledger enforces where the recipe's hardware is simulated (on CPU): the
    capacity less the reserve, as a GPU's allocator would run out there; None on a real device."""
    hardware = recipe.hardware
    return hardware.capacity_bytes - recipe.budget.reserve_bytes if hardware.simulated else None


def _measures_static(budget: Budget) -> bool:
    """Whether the static bytes are measured on the live model: `non_activation_bytes: auto` and no
    sharding engine (its shards are not the parameters' storages; ZeRO at any stage has reduce
    buckets, so its optimizer partitions are priced by formula at stage 1 too)."""
    engine = budget.fsdp or budget.shard_gradients or budget.offload_optimizer or budget.engine_buffer_bytes
    return budget.non_activation_bytes == "auto" and not engine


class Provisioner:
    def __init__(self, model: nn.Module, recipe: Recipe, cost: CostModel | None = None, kind: ForwardKind = ForwardKind()):
        """`model` is this pipeline rank's stage; `cost` its cost model (default: the analytic one
        of the model's config, for forwards of `kind`: a trainer that knows how its forwards run,
        TRL's fused head, has the floor checked for those, not for a plain forward it never
        runs). With `pipeline.pp` 1 the micro-batches' boundaries are found on the model
        (`runtime.boundaries`): no engine needs to call begin_forward and the rest."""
        adapter = self._check(model, recipe, cost, kind)
        self.runtime = PlanRuntime(model, options=mitigation_options(recipe), capacity_bytes=_simulated_capacity(recipe))
        self.static = StaticMemory(adapter.model, self.ledger) if _measures_static(recipe.budget) else None
        # the cost model of each kind of forward (`costmodel.ForwardKind`: attention with a mask, TRL's fused
        # head), the decider's, built when the first micro-batch of that kind comes (`_add`); a given one has no twins
        first = cost or model_cost(model, recipe.hardware, kind)
        self._given_cost = cost is not None
        static = None if self.static is None else self.static.measure()
        self.decider = Decider(Stage.of(recipe, first, split=False, static_bytes=static), {kind: first}, on_plan=self._prepare)
        self.ledger.static_bytes = self.stage.static_bytes
        # the last resort, whatever the strategies a plan may use: a save past the capacity moves kept
        # activations to the host first, rather than end the job
        self.ledger.spill_at = self.stage.capacity
        weight = adapter.weight
        self.calibration = Calibration(adapter.family.model_type, f"{DTYPES[weight.dtype]} weights on {weight.device.type}")
        # the schedule's phase of each forward: 1F1B's steady phase starts one forward before
        # Algorithm 1's does (that forward also runs before any backward, so it is budgeted as warmup)
        self.phases = {s.micro_batch: s.phase for s in self.stage.schedule if s.kind == "F"}
        self.executor = None  # the fused executor engines run this stage through (`runtime.dual_batch`), made on first use
        self._groups = {part.index: expert_group(part.experts) for part in adapter.layers if part.moe}  # None: one process
        self._lockstep, self._ops = lockstep_group(recipe), first.ops()  # the ranks that recompute the same ops, and those ops
        self.log = EventLog(recipe)  # the latest micro-batches' events, the telemetry file, the figures
        self.events = self.log.events
        self.forwards, self.planner_s = 0, 0.0  # running totals over all of them
        self._running: _Running | None = None
        # per kind, the largest (tokens, seq_len) whose M0 was checked: none holds another, so a stream of new
        # shapes keeps a few, whatever its length
        self._checked: dict[ForwardKind, list[tuple[int, int]]] = {}
        self._peak = 0  # peak_device_bytes before the static bytes last changed
        self._spill_named = False
        self._install(adapter, kind)

    def _check(self, model: nn.Module, recipe: Recipe, cost: CostModel | None, kind: ForwardKind) -> Adapter:
        """The model's adapter, once what `bgl.apply` refuses is ruled out: a given cost model for
        another kind than plain forwards, a Provisioner installed already, another recompute
        than ours, an expert group that is not the recipe's."""
        if cost is not None and kind != ForwardKind():
            raise ValueError(f"Provisioner: a given cost model describes plain forwards; kind {kind} needs the analytic one (cost=None)")
        adapter = Adapter(model)
        if getattr(adapter.model, INSTALLED_ATTR, None) is not None:
            raise ValueError("bgl.apply: this model has a Provisioner installed already; call .remove() on it first")
        self._owner = _RecomputeOwner(adapter.model)
        self._owner.check(frozenset(adapter.model.modules()))
        _check_expert_group(adapter, recipe)
        return adapter

    def _install(self, adapter: Adapter, kind: ForwardKind) -> None:
        """The plan's hooks, the gate monitor (on while a forward runs), the op tracker's listener,
        the boundaries where no engine calls `begin_forward` (pp 1), the static bytes' watch."""
        self.runtime.install()
        self.gate = GateMonitor(self.runtime.adapter, on_gate=self._on_gate, per_expert=False).install()
        self.gate.active = False
        self.runtime.tracker.listeners.append(self._entered)
        setattr(adapter.model, INSTALLED_ATTR, self)
        self.boundaries = Boundaries(self, kind.autocast) if self.recipe.pipeline.pp == 1 else None
        if self.static is not None:
            self.static.watch(self._rebase)

    def _prepare(self, gates: GatePlan) -> None:
        """A plan a band serves for the first time, with every escalation its gates may make:
        validated and its regions found (per layer's block, so that escalations of several layers
        compose), its telemetry names made, now, before a forward runs it."""
        plan = gates.decision.plan
        plan.named()
        self.runtime.regions(plan)
        for layer, cost in gates.costs.items():
            self.runtime.block_regions(layer, escalated_block(plan.block(layer)))
            if cost.collective is not None:
                self.runtime.block_regions(layer, escalated_block(plan.block(layer), COLLECTIVE_OPS))

    @property
    def stage(self) -> Stage:
        return self.decider.stage

    @property
    def recipe(self) -> Recipe:
        return self.decider.stage.recipe

    def _set_stage(self, stage: Stage) -> None:
        self.decider.set_stage(stage)
        self.ledger.static_bytes = stage.static_bytes

    def _add(self, kind: ForwardKind) -> None:
        """Plan micro-batches of `kind` on their own cost model (the decider's from now on)."""
        if not self._given_cost:
            cost = model_cost(self.runtime.adapter.model, self.recipe.hardware, kind)
        else:  # a given cost model: plan the micro-batch as if its forward were plain
            warnings.warn(
                f"a micro-batch's forward runs as {kind} (a masked attention, TRL's fused head, a counted or auxiliary "
                "loss, autocast), which the cost model given to bgl.apply does not describe: it is planned as a plain forward; let "
                "bgl.apply build its cost model",
                RuntimeWarning, stacklevel=4,
            )
            cost = self.decider.costs[ForwardKind()]
        self.decider.add(kind, cost)

    def _rebase(self) -> None:
        """Algorithm 1's M_used follows the measured static bytes (an optimizer's first step adds
        its state; on CUDA the allocator is read again at each iteration): never above capacity."""
        static = self.static.measure()
        if static == self.stage.static_bytes:
            return
        before = self.stage.static_bytes
        self._peak = self.peak_device_bytes  # the peak so far, on the static bytes of its time
        self.ledger.reset_peak(allocator=False)
        try:
            self._set_stage(replace(self.stage, static_bytes=static))
        except ValueError as error:
            raise ValueError(
                f"the weights, gradients and optimizer state now take {static} bytes on the device (were {before}): {error}"
            ) from None

    def _grow(self, mb: int, forward: Forward) -> None:
        """A micro-batch larger than any of its kind before (or of a kind none was): M0 at its
        shape and kind, checked to fit; the stage keeps the larger M0. Each kind is checked at its
        own shapes: a padded micro-batch as long as the plain ones keeps more than they do."""
        tokens, seq_len, kind = forward.tokens, forward.seq_len, forward.kind
        if kind not in self.decider.costs:
            self._add(kind)
        checked = self._checked.setdefault(kind, [])
        if any(tokens <= t and seq_len <= s for t, s in checked):
            return
        self._floor(mb, forward)
        checked[:] = [(t, s) for t, s in checked if not (t <= tokens and s <= seq_len)] + [(tokens, seq_len)]

    def _floor(self, mb: int, forward: Forward) -> None:
        """M0 at micro-batch `mb`'s shape and kind, checked to fit; the stage keeps the larger M0."""
        stage, tokens, seq_len = self.stage, forward.tokens, forward.seq_len
        batch = Batch(seq_len=seq_len, micro_batch_size=-(-tokens // seq_len))
        try:
            recipe = stage.recipe.model_copy(update={"batch": batch})
            grown = Stage.of(recipe, self.decider.costs[forward.kind], split=False, static_bytes=stage.static_bytes)
            if grown.min_budget > stage.min_budget:
                self._set_stage(replace(grown, cost=stage.cost, chunks=stage.chunks))
        except ValueError as error:
            raise ValueError(
                f"micro-batch {mb} of {tokens} tokens ({batch.micro_batch_size} x {seq_len}) cannot fit: {error}"
            ) from None

    @property
    def ledger(self) -> Ledger:
        return self.runtime.ledger

    @property
    def micro_batches(self) -> MicroBatches:
        """Each micro-batch's state, and the one running (`runtime.micro_batches`)."""
        return self.runtime.micro_batches

    @property
    def peak_device_bytes(self) -> int:
        """The most device memory the stage has used since it was built: static bytes and the
        Ledger's activations together (on CPU, the simulated device's)."""
        return max(self._peak, self.stage.static_bytes + self.ledger.peak_device_bytes)

    @torch.compiler.disable  # host-side decisions on numpy arrays (`planner.path`): never traced into a compiled graph
    def begin_forward(
        self, mb: int, forward: Forward, *, phase: str | None = None, in_flight: int | None = None,
        ids: torch.Tensor | None = None, varlen_bytes: int = 0,
    ) -> Event:
        """Budget and plan micro-batch `mb`, whose forward is `forward` (its tokens, sequence length
        and kind; its routing comes at its gates), for the normal routing band; its saved tensors
        go through the plan until `end_forward`. An engine that knows the schedule passes `phase`
        ("warmup" or "steady") and `in_flight` (micro-batches awaiting backward, nanotron's
        `len(state.microbatches_activations_requiring_backward)`): they are checked against
        Algorithm 1's state, whose budgets are wrong if the two disagree. `ids`: the token ids the
        model is given, when the caller has them: a view of a larger tensor (a micro-batch sliced
        from a batch) keeps all of it through the embedding's saved ids, which the plan makes room
        for (`_ids_view_bytes`). `varlen_bytes`: the storages of the varlen arguments the model is
        given (`runtime.forward_kind.varlen_bytes`: TRL's padding-free packing), which a region
        holding the layer arguments keeps: made room for too. Returns the micro-batch's event,
        which its forward and backward complete."""
        if self._running is not None:
            raise ValueError(f"begin_forward({mb}): the forward of micro-batch {self._running.event.micro_batch} has not ended")
        if forward.routed is not None:
            raise ValueError(f"begin_forward({mb}): forward.routed is known before the forward; give it to foresee({mb}, forward) instead")
        if mb == 0:  # a new iteration: Algorithm 1 starts over, with nothing left of the last one
            self._new_iteration()
        start = time.perf_counter()  # the planner's time from here: the checks of the model above are not its
        if mb == 0:
            if self.static is not None and self.ledger.device.type == "cuda":
                self._rebase()
            self.decider.start_iteration(self.ledger.live_device_bytes)  # graphs kept from before (an abandoned forward's)
        self._grow(mb, forward)
        scheduled = self._scheduled(mb, phase, in_flight)
        view = self._ids_view_bytes(ids)
        decided = self._decide(mb, forward, view + varlen_bytes)
        decision = decided.gates.decision
        self.runtime.set_plan(decided.plan)
        event = Event(
            mb, scheduled, decided.budget, decision.activation_bytes, decided.plan.named(), decided.escalations, decided.deferred,
            forward.tokens, forward.seq_len, decision.room_bytes, routed=decided.routed, balanced_pairs=decided.balanced,
            kind=forward.kind._asdict(), capacity=self.stage.capacity, forward=self.forwards,
            mitigation_s=decision.forward_extra_s + decision.backward_extra_s, ids_view_bytes=view, varlen_bytes=varlen_bytes,
        )
        self.micro_batches.running = mb
        hooks = ExitStack()
        hooks.enter_context(self.runtime.forward(refresh=False))
        hooks.callback(setattr, self.gate, "active", False)
        self.gate.active = True
        expected = Expected(self.decider.costs[forward.kind], forward, self.stage.options)
        self._running = _Running(event, decided, hooks, forward, expected, self.ledger.spilled_bytes)
        event.planner_s = time.perf_counter() - start
        return event

    def _new_iteration(self) -> None:
        """Before an iteration's first forward: the model moved or wrapped since (`.cuda()`, DDP's
        prepare) is walked again, its recompute still ours, the last iteration's backwards all ended."""
        self.ledger.refresh_if_changed()
        self._owner.check(self.ledger.modules)
        awaiting = self.micro_batches.awaiting()
        if awaiting:
            raise ValueError(f"begin_forward(0): micro-batches {awaiting} of the last iteration await end_backward")

    def _scheduled(self, mb: int, phase: str | None, in_flight: int | None) -> str:
        """Micro-batch `mb`'s phase in the schedule, checked against what the engine says of it."""
        pipe, scheduled = self.recipe.pipeline, self.phases.get(mb, "steady")
        for name, given, wanted in (("phase", phase, scheduled), ("in_flight", in_flight, len(self.micro_batches.awaiting()))):
            if given is not None and given != wanted:
                raise ValueError(
                    f"begin_forward({mb}): the engine says {name}={given!r}, but pipeline rank {pipe.rank} of "
                    f"pp {pipe.pp} running 1F1B expects {wanted!r}: check the recipe's pipeline section against "
                    "the engine, and that end_backward is called"
                )
        return scheduled

    def _decide(self, mb: int, forward: Forward, held: int) -> Decisions:
        """Micro-batch `mb`'s budget and plan (its foreseen routing's, else the normal band's),
        `held` bytes kept beyond its cost model whatever the plan; under lockstep with every op
        another rank recomputes."""
        # plan for the common case (97.1% of iterations stay under normal_max_imbalance, §II-B),
        # leaving each gate what it needs to catch routing up to spike_max_imbalance
        state = self.micro_batches.of(mb)
        foreseen, state.foreseen = state.foreseen, None
        if foreseen is not None and replace(foreseen[0], routed=None) != forward:
            raise ValueError(f"begin_forward({mb}): foreseen for {foreseen[0]}, but {forward} comes")
        foresight = None if foreseen is None else foreseen[1]
        decided = self.decider.begin(mb, forward.tokens, forward.seq_len, forward.kind, foresight, held=held)
        decision = decided.gates.decision
        if decided.slack + decided.gates.floor < 0:
            warnings.warn(
                f"micro-batch {mb}: its budget of {decided.budget} bytes is below what any plan keeps at the normal band's "
                f"routing, every gate escalated ({decision.activation_bytes + decision.room_bytes - decided.gates.floor:.0f} "
                "bytes): it runs the most mitigated plan, which fits only lighter routing; raise the capacity or the pipeline "
                "degree, or shorten the micro-batch",
                RuntimeWarning, stacklevel=3,
            )
        if self._lockstep is not None:  # every op another rank of the group recomputes, recomputed here too
            decided.plan = recomputed_anywhere(decided.plan, self._ops, self._lockstep, self.ledger.device)
        return decided

    @property
    def running_kind(self) -> ForwardKind | None:
        """The kind of the forward running now (between `begin_forward` and `end_forward`); None
        when none is."""
        return None if self._running is None else self._running.forward.kind

    def awaits_backward(self, mb: int | None = None) -> bool:
        """Whether micro-batch `mb`'s forward has ended and its backward not (`mb` None: any's)."""
        if mb is None:
            return bool(self.micro_batches.awaiting())
        state = self.micro_batches.get(mb)
        return state is not None and state.event is not None

    def rekind(self, kind: ForwardKind) -> None:
        """The running forward is of `kind` after all: autocast entered inside the model's forward
        (accelerate's wrapper), seen at its decoder before it saved anything. Its gates and the
        check after it measure it as one; its plan stays (the model's pre-hooks armed for it)."""
        f = self._running
        if f is None:
            raise ValueError("rekind: no forward is running")
        f.forward = replace(f.forward, kind=kind)
        self._grow(f.event.micro_batch, f.forward)
        f.event.kind = kind._asdict()
        f.expected = Expected(self.decider.costs[kind], f.forward, self.stage.options)

    def _ids_view_bytes(self, ids: torch.Tensor | None) -> int:
        """The bytes of the storage behind `ids` beyond the ids themselves, which the cost model
        does not know of: a training embedding saves the ids it is given for its weight's
        gradient, and a view (`for ids in batch`, `batch[:, :n]`) keeps its whole storage. 0 where
        the embedding saves none (it does not train: LoRA) or the ids are their own tensor."""
        weight = getattr(getattr(self.runtime.adapter.decoder, "embed_tokens", None), "weight", None)
        found = None if ids is None or weight is None or not weight.requires_grad else _storage(ids)
        return 0 if found is None else found[1] - ids.numel() * ids.element_size()

    def routing(self, forward: Callable[..., object], /, *args, **kwargs) -> dict[int, int]:
        """The local routed pairs per MoE layer of `forward(*args, **kwargs)` (the model), run now without gradients, plan or
        decisions: an oracle's first pass, whose forward routes as the training forward will
        (under expert parallelism every rank of the group runs it at once: dispatch exchanges the
        counts)."""
        if self._running is not None:
            raise ValueError(f"routing(): the forward of micro-batch {self._running.event.micro_batch} has not ended")
        self.gate.reset()
        self.gate.active = True
        try:
            with torch.no_grad():
                forward(*args, **kwargs)
        finally:
            self.gate.active = False
        routed = self.gate.local_pairs()
        self.gate.reset()
        return routed

    def foresee(self, mb: int, forward: Forward) -> None:
        """Micro-batch `mb`'s next forward is `forward`, its local routed pairs per MoE layer known
        (`forward.routed`: `routing`'s): it is planned by Algorithm 2 for that routing, not for
        the normal band (paper §V-A's planning with the routing known: the oracle benchmarks
        measure adaptive provisioning against). Prepared now, so its forward decides by lookup."""
        if forward.routed is None:
            raise ValueError(f"foresee({mb}): forward.routed is None; give the routing the forward will bring (routing())")
        self._grow(mb, forward)
        cost = self.decider.costs[forward.kind]
        loads = cost.loads(forward)  # a routing that is not one number or one per MoE layer: the error names the layers
        routed = {layer: loads[layer].routed for layer in cost.moe_layers}
        self.micro_batches.of(mb).foreseen = (forward, self.decider.foresee(forward.tokens, forward.seq_len, routed, forward.kind))

    def _on_gate(self, layer: int, tokens_per_expert: torch.Tensor | None, local_pairs: torch.Tensor | int) -> None:
        """Deferred planning: the experts of `layer` have not run yet (`planner.at_gate`). Under
        expert parallelism every rank of the group answers whether one asks for the collective
        escalation, at every gate (so the ranks' collectives stay in one order)."""
        f = self._running
        if f is None or layer not in f.decided.gates.costs:
            return
        group, before = self._groups.get(layer), f.decided.plan
        pairs = int(local_pairs)  # a host sync where pairs are counted on the device (two under EP)
        start = time.perf_counter()  # the planner's time from here: the device's work before is not its
        # what the blocks before the gate, and this layer's ops that ran before it, kept beyond
        # their prediction, as a spike's pairs would
        kept = self.ledger.decoder_bytes(f.event.micro_batch)  # its layers' so far: this one's and those before it
        ran = f.ran.get(layer, set()) - _COLLECTIVE  # entered, not run (under EP)
        expected = f.expected.before(layer, before, f.decided.routed) + f.expected.ran(layer, before, pairs, ran)
        beyond = kept - expected - f.beyond
        if beyond > 0:
            f.decided.slack -= beyond
            f.beyond += beyond
        device = self.ledger.device
        agree = None if group is None else (lambda asks: any_rank(asks, group.group, device))
        lockstep = None if self._lockstep is None else (lambda asks: any_rank(asks, self._lockstep, device))
        self.decider.at_gate(f.decided, layer, pairs, agree, lockstep)
        if f.decided.plan is not before:
            self.runtime.set_plan(f.decided.plan)
        f.event.planner_s += time.perf_counter() - start

    def _entered(self, op: OpId) -> None:
        """The op tracker's listener: which ops the running forward has entered (`_on_gate`)."""
        if self._running is not None:
            self._running.ran.setdefault(op.layer, set()).add(op.name)

    def end_forward(self, mb: int) -> int:
        """The bytes micro-batch `mb` really keeps; its budget becomes that, with the room its
        backward needs to bring offloaded copies back (Algorithm 1; the Ledger counts restored
        copies on the device, as the allocator does)."""
        f = self._running
        if f is None or f.event.micro_batch != mb:
            raise ValueError(f"end_forward({mb}): no forward of micro-batch {mb} is running")
        f.hooks.close()
        self._running = None
        actual = self.ledger.by_micro_batch().get(mb, 0)
        self.decider.end(f.decided, actual + round(f.event.room_bytes))
        e = f.event
        e.actual = actual
        e.spilled_bytes = self.ledger.spilled_bytes - f.spilled_before
        if e.spilled_bytes and not self._spill_named:
            self._spill_named = True
            warnings.warn(
                f"bagualu: micro-batch {mb} kept more than its plan was made for, past the capacity of "
                f"{fmt_bytes(self.stage.capacity)}: {fmt_bytes(e.spilled_bytes)} of activations it had kept were moved to host "
                "memory and come back as its backward needs them (gradients unchanged, the step slower); the cost-model "
                "warning names what kept more, and later micro-batches are planned on it (Event.spilled_bytes)",
                RuntimeWarning, stacklevel=2,
            )
        cost = self.decider.costs[f.forward.kind]
        f.forward = replace(f.forward, routed=gate_pairs(cost, e.routed))  # as its gates saw it
        e.mitigated = cost.mitigated(f.forward, f.decided.plan, self.stage.options)
        self._calibrate(f)
        e.peak_device_bytes = self.peak_device_bytes
        e.device_bytes = self.stage.static_bytes + self.ledger.live_device_bytes
        self.log.ended(e)
        self.forwards += 1
        self.planner_s += e.planner_s
        self.micro_batches.of(mb).event = e
        return actual

    def _calibrate(self, f: _Running) -> None:
        """Forward `f`'s bytes per op against its kind's cost model (`runtime.calibration`): the
        misses in its event; the kind planned on a corrected cost model from now on where an op
        kept more, whose floor is checked at once (an error with the numbers where it no longer fits)."""
        e, cost = f.event, self.decider.costs[f.forward.kind]
        measured = self.ledger.by_op(micro_batch=e.micro_batch)
        for op, n in self.ledger.by_op("spilled", micro_batch=e.micro_batch).items():  # kept, then moved by the Ledger
            measured[op] = measured.get(op, 0) + n
        if not measured:  # its saves are gone already (its backward ran before end_forward): nothing to compare
            return
        e.misses, corrected = self.calibration.check(
            f.forward, cost, measured, f.decided.plan, self.stage.options, e.ids_view_bytes, e.varlen_bytes
        )
        if corrected is not cost:
            self.decider.add(f.forward.kind, corrected)
            self._floor(e.micro_batch, f.forward)

    def end_backward(self, mb: int) -> int:
        """Micro-batch `mb`'s activations are released; returns what the stage still keeps (the
        memory Algorithm 1 hands to the next forward), recorded in `mb`'s event, which is then
        complete and written to the telemetry file."""
        live = self.ledger.live_device_bytes
        state = self.micro_batches.get(mb)
        event = None if state is None else state.event
        if event is None:
            raise ValueError(f"end_backward({mb}): micro-batch {mb} has no finished forward awaiting its backward")
        event.live_after_backward = live
        self.runtime.release(mb)
        self.log.complete(event)
        return live

    def figures(self) -> dict[str, float]:
        """The `bagualu/*` figures for a logger (`accelerator.log(prov.figures(), step=step)`; the
        Trainer callback and nanotron's launcher log them themselves): `EventLog.figures`."""
        return self.log.figures(self.peak_device_bytes, self.stage.capacity)

    def micro_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> AbstractContextManager[int]:
        """One micro-batch of a loop without pipeline parallelism, explicitly: its forward and
        backward run inside the block (`runtime.boundaries.Boundaries.explicit`); pass the
        forward's `attention_mask` where it pads. Without the block the plugin finds the same
        boundaries itself."""
        if self.boundaries is None:
            pp = self.recipe.pipeline.pp
            raise ValueError(f"micro_batch() runs without pipeline parallelism, but the recipe has pipeline.pp={pp}")
        return self.boundaries.explicit(input_ids, attention_mask)

    def executor_of(self, make: Callable[[], object]) -> object:
        """The fused executor engines run this stage through (`runtime.dual_batch`), made by
        `make()` the first time: its schedules outlive an iteration, as the stage does, and an
        abandoned iteration restarts it."""
        if self.executor is None:
            self.executor = make()
        return self.executor

    def abandon(self, error: BaseException | None = None) -> None:
        """The micro-batches begun and not ended (a step raised, or a forward's output never went
        backward) leave nothing behind: their forward's hooks closed, the fused executor's
        micro-batches dropped, their events dropped, what their graphs still keep no longer
        theirs (`Ledger.retire`), and the next micro-batch begins a new iteration. `error`: what
        ended them; a device's out-of-memory error gets a note of what the Ledger counted against
        the capacity (the Ledger's simulated one says so already)."""
        if isinstance(error, torch.OutOfMemoryError) and not isinstance(error, SimulatedOutOfMemoryError):
            error.add_note(self._memory_note())
        if self._running is not None:
            self._running.hooks.close()
            self.ledger.retire(self._running.event.micro_batch)
            self._running = None
        if self.executor is not None:
            self.executor.start()
        dropped = []
        for state in self.micro_batches:
            if state.event is not None:
                dropped.append(state.event)
                self.ledger.retire(state.index)
            state.foreseen = state.event = None
        if dropped:
            self.log.drop(dropped)
            self.forwards -= len(dropped)

    def _memory_note(self) -> str:
        ledger, stage = self.ledger, self.stage
        counted = sorted(ledger.by_micro_batch().items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        held = ", ".join(f"{mb}: {fmt_bytes(b)}" for mb, b in counted) or "none"
        return (
            f"bagualu: the Ledger counted {fmt_bytes(ledger.live_device_bytes)} of saved activations on the device "
            f"(by micro-batch: {held}; peak {fmt_bytes(ledger.peak_device_bytes)}) and {fmt_bytes(stage.static_bytes)} "
            f"of static memory, against a capacity of {fmt_bytes(stage.capacity)} (hardware.capacity_bytes less "
            "budget.reserve_bytes): raise the reserve if the allocator's own memory (fragmentation, communication "
            "buffers, workspaces) is what ran out"
        )

    def remove(self) -> None:
        """Uninstall everything; the events stay readable."""
        if self.boundaries is not None:
            self.boundaries.remove()
        if self.static is not None:
            self.static.remove()
        self.abandon()
        self.gate.remove()
        self.runtime.tracker.listeners.remove(self._entered)
        self.runtime.remove()
        self.log.close()
        if getattr(self.runtime.adapter.model, INSTALLED_ATTR, None) is self:
            delattr(self.runtime.adapter.model, INSTALLED_ATTR)


def apply(model: nn.Module, recipe: Recipe | dict | str | os.PathLike[str] | None = None, cost: CostModel | None = None) -> Provisioner:
    """`bgl.apply`: install adaptive activation provisioning on `model`. `recipe`: a full `Recipe`
    as it is, or what `bgl.derive_recipe` completes from the model, the device and the launcher
    (absent, a partial dict or a YAML path)."""
    return Provisioner(model, recipe if isinstance(recipe, Recipe) else derive_recipe(model, recipe), cost)
