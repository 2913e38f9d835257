"""`bgl.apply(model, recipe)`: per-micro-batch control of activation memory (paper §V-A).

At each pipeline scheduling point the Provisioner gives the next forward micro-batch its budget
(Algorithm 1), plans per-operator mitigation for the routing it expects (Algorithm 2, cached),
and installs the plan. Right after each MoE gate the real local routed pairs are known: if they
would take the micro-batch over its budget, then in warmup, when the later warmup micro-batches
can give the bytes up and still keep M0, their budgets shrink instead; otherwise that layer's
routed experts are recomputed as one unit before they run (deferred planning). That is the
strongest escalation left once the router has run (the paper recomputes the whole MoE block),
and it holds nothing per routed pair, the only bytes a spike adds. After the forward the budget
is replaced by what the Ledger counted. The engine (nanotron's pipeline, or `run_stage` here) calls `begin_forward`,
`end_forward`, `end_backward`.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..adapters.costs import model_cost
from ..adapters.gate import GateMonitor
from ..config import Recipe
from ..costmodel import CostModel, OpId
from ..costmodel.mitigation import footprint
from ..costmodel.pipeline import one_f_one_b
from ..costmodel.graph import EXPERT_OPS
from ..costmodel.plan import Plan
from ..planner import BudgetState, CachedPlanner
from ..stage import Stage
from .ledger import Ledger
from .plan_runtime import PlanRuntime


EVENTS_KEPT = 4096  # events held in memory; the telemetry file has them all


class Provisioner:
    def __init__(self, model: nn.Module, recipe: Recipe, cost: CostModel | None = None):
        """`model` is this pipeline rank's stage; `cost` its cost model (default: the analytic one
        of the model's config)."""
        self.recipe = recipe
        self.stage = Stage.of(recipe, cost or model_cost(model, recipe.hardware), split=False)
        pipe = recipe.pipeline
        capacity = recipe.hardware.capacity_bytes - recipe.budget.reserve_bytes
        self.warmup = min(pipe.pp - pipe.rank, pipe.micro_batches)
        self._first = BudgetState.start(capacity, self.stage.static_bytes, self.stage.min_budget, self.warmup)
        self.budgets = self._first
        balanced = self.stage.tokens * self.stage.cost.pairs_per_token
        self.planner = CachedPlanner(  # cache buckets: 1/16 of M0 and of the balanced routing
            self.stage.cost,
            budget_quantum=max(1, self.stage.min_budget // 16),
            routed_quantum=max(1, int(balanced) // 16),
            strategies=recipe.strategies.allowed,
            options=self.stage.options,
        )
        self.runtime = PlanRuntime(
            model,
            options=self.stage.options,
            capacity_bytes=capacity if recipe.hardware.simulated else None,
            static_bytes=self.stage.static_bytes,
        ).install()
        par = recipe.parallel
        self.gate = GateMonitor(self.runtime.adapter, par.ep, par.ep_rank, on_gate=self._on_gate).install()
        self.telemetry = Path(recipe.telemetry.path) if recipe.telemetry.path else None
        # the latest micro-batches' events (a long run would otherwise grow without bound) and
        # running totals over all of them
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        self.forwards, self.planner_s = 0, 0.0
        self._awaiting_backward: dict[int, dict] = {}
        self._mb: int | None = None
        self._forward = None
        self._slopes: dict[tuple, dict[int, float]] = {}

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
        if mb == 0:  # a new iteration: Algorithm 1 starts over
            self.budgets = self._first
        # the schedule's phase: 1F1B's steady phase starts one forward before Algorithm 1's does
        # (that forward also runs before any backward, so Algorithm 1 budgets it as warmup)
        pipe = self.recipe.pipeline
        scheduled = "warmup" if mb < min(pipe.pp - pipe.rank - 1, pipe.micro_batches) else "steady"
        for name, given, wanted in (("phase", phase, scheduled), ("in_flight", in_flight, len(self._awaiting_backward))):
            if given is not None and given != wanted:
                raise ValueError(
                    f"begin_forward({mb}): the engine says {name}={given!r}, but pipeline rank {pipe.rank} of "
                    f"pp {pipe.pp} running 1F1B expects {wanted!r}: check the recipe's pipeline section against "
                    "the engine, and that end_backward is called"
                )
        budget = self.budgets.budget(mb)
        # plan for the common case (97.1% of iterations stay under normal_max_imbalance, §II-B);
        # heavier routing is caught at the gate
        self._planned = tokens * self.stage.cost.pairs_per_token * self.recipe.spikes.normal_max_imbalance
        decision = self.planner.plan(budget, tokens, [self._planned] * len(self.stage.cost.moe_layers), seq_len)
        self.runtime.set_plan(decision.plan)
        self._event = {
            "micro_batch": mb,
            "phase": scheduled,
            "budget": budget,
            "predicted": decision.activation_bytes,
            "plan": {str(op): s for op, s in sorted(decision.plan.items())},
            "escalations": [],
            "deferred": [],
            "tokens": tokens,
            "seq_len": seq_len,
        }
        self._slack = budget - decision.activation_bytes
        self._headroom = self.budgets.headroom(mb)
        key = (tuple(sorted(decision.plan.items())), tokens, seq_len)
        if key not in self._slopes:  # as few as the planner's cached decisions
            self._slopes[key] = self._expert_bytes_per_pair()
        self._per_pair = self._slopes[key]
        self.ledger.micro_batch = mb
        self._mb = mb
        self._forward = self.runtime.forward()
        self._forward.__enter__()
        self._event["planner_s"] = time.perf_counter() - start

    def _expert_bytes_per_pair(self) -> dict[int, float]:
        """Device bytes each extra local routed pair costs in each MoE layer under the plan."""
        step = 1024
        return {
            layer: (self._layer_bytes(layer, self.runtime.plan, self._planned + step)
                    - self._layer_bytes(layer, self.runtime.plan, self._planned)) / step
            for layer in self.stage.cost.moe_layers
        }

    def _layer_bytes(self, layer: int, plan: Plan, routed: float) -> float:
        """What MoE layer `layer` of this micro-batch keeps under `plan` with `routed` local pairs."""
        cm = self.stage.cost
        load = cm.loads(self._event["tokens"], routed, self._event["seq_len"])[layer]
        names = {op.name: s for op, s in plan.items() if op.layer == layer}
        return footprint(cm.blocks[layer], names, load, cm.hardware, self.stage.options).device_bytes

    def _on_gate(self, layer: int, tokens_per_expert: torch.Tensor, local_pairs: torch.Tensor) -> None:
        """Deferred planning: the experts of `layer` have not run yet; if the pairs routed here
        would overrun this micro-batch's slack, defer to later warmup budgets or recompute them."""
        if self._mb is None or layer not in self._per_pair:
            return
        pairs = int(local_pairs)  # one host sync per MoE layer
        extra = (pairs - self._planned) * self._per_pair[layer]
        if extra <= self._slack:
            self._slack -= max(extra, 0)
            return
        overrun = extra - self._slack
        if overrun <= self._headroom:  # warmup: the later micro-batches' budgets shrink instead
            self._headroom -= overrun
            self._slack = 0
            self._event["deferred"].append({"layer": layer, "local_pairs": pairs, "overrun": overrun})
            return
        planned = self.runtime.plan
        escalated = Plan({**planned, **{OpId(layer, n): "recompute" for n in EXPERT_OPS}})
        self.runtime.set_plan(escalated)
        # the layer now keeps only what its experts' checkpoint holds: the slack left is exact again
        change = self._layer_bytes(layer, escalated, pairs) - self._layer_bytes(layer, planned, self._planned)
        self._slack -= change
        self._event["escalations"].append({"layer": layer, "local_pairs": pairs, "overrun": overrun, "slack_after": self._slack})

    def end_forward(self, mb: int) -> int:
        """The bytes micro-batch `mb` really keeps; its budget becomes that (Algorithm 1)."""
        self._forward.__exit__(None, None, None)
        self._forward, self._mb = None, None
        actual = self.ledger.by_micro_batch().get(mb, 0)
        self.budgets = self.budgets.after_forward(mb, actual)
        self._event["actual"] = actual
        self._event["peak_device_bytes"] = self.ledger.peak_device_bytes + self.stage.static_bytes
        self.events.append(self._event)
        self.forwards += 1
        self.planner_s += self._event["planner_s"]
        self._awaiting_backward[mb] = self._event
        return actual

    def end_backward(self, mb: int) -> int:
        """Micro-batch `mb`'s activations are released; returns what the stage still keeps (the
        memory Algorithm 1 hands to the next forward), recorded in `mb`'s event, which is then
        complete and written to the telemetry file."""
        live = self.ledger.live_device_bytes
        event = self._awaiting_backward.pop(mb, None)
        if event is None:
            raise ValueError(f"end_backward({mb}): micro-batch {mb} has no finished forward awaiting its backward")
        event["live_after_backward"] = live
        if self.telemetry:
            with self.telemetry.open("a") as f:
                f.write(json.dumps(event) + "\n")
        return live

    def remove(self) -> None:
        self.gate.remove()
        self.runtime.remove()


def apply(model: nn.Module, recipe: Recipe, cost: CostModel | None = None) -> Provisioner:
    """`bgl.apply`: install adaptive activation provisioning on `model` as `recipe` says."""
    return Provisioner(model, recipe, cost)


def run_stage(
    provisioner: Provisioner, model: nn.Module, batches: Sequence[torch.Tensor], pp: int, rank: int
) -> list[float]:
    """One iteration of pipeline rank `rank` of `pp` on one process: forwards and backwards in
    nanotron's 1F1B order, so warmup micro-batches' activations really stay alive together."""
    losses: dict[int, torch.Tensor] = {}
    for step in one_f_one_b(pp, rank, len(batches)):
        ids = batches[step.micro_batch]
        if step.kind == "F":
            provisioner.begin_forward(step.micro_batch, ids.numel(), ids.shape[-1], phase=step.phase, in_flight=len(losses))
            try:
                losses[step.micro_batch] = model(input_ids=ids, labels=ids).loss
            finally:
                provisioner.end_forward(step.micro_batch)
        else:
            loss = losses.pop(step.micro_batch)
            loss.backward()
            del loss
            provisioner.end_backward(step.micro_batch)
    return [e["actual"] for e in list(provisioner.events)[-len(batches):]]
