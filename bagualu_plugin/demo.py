"""The spike demo: adaptive provisioning against static policies on one real model (paper §II-B,
§VI-C), on CPU with a simulated device capacity (DESIGN.md section 6).

A tiny GLM-4-MoE runs as rank 0 of a 4-stage 1F1B pipeline and rank 0 of 4 emulated expert-
parallel ranks, with the recipe's routing spikes (97.1% of iterations under 1.2x, 2.9% up to
2.6x by default, or as configured). Every policy runs the same iterations:

- adaptive: `bgl.apply` (per-micro-batch budgets, plans, gate-time escalation);
- none: nothing mitigated (under-provisioned);
- full_recompute: every decoder layer recomputed (over-provisioned);
- static_average / static_worst: one per-op plan for all micro-batches, sized by Algorithm 2 for
  balanced routing (AdaPipe-like) or for the largest spike.

A static policy that runs out of memory is handled as the paper does: the OOM is counted, a
restart costs `restart_iterations` times its mean iteration time, and it continues with full
recompute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
from .runtime.mitigation import PlanRuntime
from .runtime.profiler import profile
from .runtime.provisioner import Provisioner
from .spikes import imbalance_schedule, skew_fraction

POLICIES = ("adaptive", "none", "full_recompute", "static_average", "static_worst")


@dataclass
class PolicyResult:
    policy: str
    steps_completed: int
    ooms: int
    seconds: float  # compute time plus charged restarts
    tokens: int
    peak_device_bytes: int
    capacity_bytes: int
    planner_ms: float = 0.0
    timeline: list[dict] = field(default_factory=list)  # per forward: budget, actual, spike

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


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


def _static_plan(policy: str, recipe: Recipe, cm: CostModel, tokens: int, seq_len: int, warmup: int) -> Plan:
    if policy == "none":
        return Plan()
    if policy == "full_recompute":
        return Plan(cm.full_recompute())
    share = (recipe.hardware.capacity_bytes - recipe.budget.reserve_bytes) // warmup
    imbalance = recipe.spikes.normal_max_imbalance if policy == "static_average" else recipe.spikes.spike_max_imbalance
    routed = [tokens * cm.pairs_per_token * imbalance] * len(cm.moe_layers)
    return plan_micro_batch(cm, share, tokens, routed, seq_len, recipe.strategies.allowed).plan


def run_policy(policy: str, recipe: Recipe, steps: int, restart_iterations: int = 16, seed: int = 0) -> PolicyResult:
    """`steps` training iterations of pipeline rank 0 under `policy` (see the module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    pipe, par, batch = recipe.pipeline, recipe.parallel, recipe.batch
    model = demo_model(recipe.model, seed)
    adapter = Adapter(model)
    set_expert_parallel(adapter, par.ep, par.ep_rank)
    # profiled as the emulation runs (its routing hook and remote experts included): exact bytes
    cm = profile(model, [batch.tokens // 4, batch.tokens // 2, batch.tokens], ep_size=par.ep, ep_rank=par.ep_rank, repeats=1)
    set_expert_parallel(adapter, par.ep, par.ep_rank)
    schedule = imbalance_schedule(recipe.spikes, steps, pipe.micro_batches, cm.moe_layers)
    generator = torch.Generator().manual_seed(seed)
    batches = [
        torch.randint(0, recipe.model.vocab_size, (batch.micro_batch_size, batch.seq_len), generator=generator)
        for _ in range(pipe.micro_batches)
    ]
    capacity = recipe.hardware.capacity_bytes - recipe.budget.reserve_bytes
    warmup = min(pipe.pp - pipe.rank, pipe.micro_batches)
    result = PolicyResult(policy, 0, 0, 0.0, 0, 0, recipe.hardware.capacity_bytes)
    current, runner = policy, None
    iteration_times: list[float] = []
    for it in range(steps):
        if runner is None:  # installed once per policy; again only after a restart
            if current == "adaptive":
                runner = Provisioner(model, recipe, cm)
            else:
                runner = PlanRuntime(model, capacity_bytes=capacity).install()
                runner.set_plan(_static_plan(current, recipe, cm, batch.tokens, batch.seq_len, warmup))
        ledger = runner.ledger
        start, losses = time.perf_counter(), {}
        try:
            for step in one_f_one_b(pipe.pp, pipe.rank, pipe.micro_batches):
                mb = step.micro_batch
                imbalance = schedule[it][mb]
                # the micro-batch's routing skew also stays for its backward: a recompute must
                # route exactly as the forward did
                skews = [
                    RoutingSkew(adapter, skew_fraction(min(x, par.ep), par.ep), par.ep, par.ep_rank, layers=[layer])
                    for layer, x in imbalance.items()
                ]
                with ExitStack() as stack:
                    for skew in skews:
                        stack.enter_context(skew)
                    if step.kind == "B":
                        losses.pop(mb).backward()
                        if current == "adaptive":
                            runner.end_backward(mb)
                        continue
                    if current == "adaptive":
                        runner.begin_forward(mb, batch.tokens, batch.seq_len)
                        try:
                            losses[mb] = model(input_ids=batches[mb], labels=batches[mb]).loss
                        finally:
                            runner.end_forward(mb)
                    else:
                        ledger.micro_batch = mb
                        with runner.forward():
                            losses[mb] = model(input_ids=batches[mb], labels=batches[mb]).loss
                result.timeline.append(
                    {"iteration": it, "micro_batch": mb, "live": ledger.live_device_bytes, "spike": max(imbalance.values())}
                )
            elapsed = time.perf_counter() - start
            iteration_times.append(elapsed)
            result.seconds += elapsed
            result.steps_completed += 1
            result.tokens += batch.tokens * pipe.micro_batches
        except SimulatedOutOfMemoryError:
            losses.clear()
            result.ooms += 1
            mean = sum(iteration_times) / len(iteration_times) if iteration_times else time.perf_counter() - start
            result.seconds += restart_iterations * mean  # a cold restart, then the conservative policy
            current = "full_recompute"
            runner.remove()
            runner = None
        finally:
            result.peak_device_bytes = max(result.peak_device_bytes, ledger.peak_device_bytes)
    if isinstance(runner, Provisioner):
        result.planner_ms = sum(e["planner_s"] for e in runner.events) * 1e3
    if runner is not None:
        runner.remove()
    set_expert_parallel(adapter, 1, 0)
    return result


def run_demo(recipe: Recipe, steps: int, policies: Sequence[str] = POLICIES, progress: bool = False) -> list[PolicyResult]:
    from tqdm.auto import tqdm

    return [run_policy(p, recipe, steps) for p in tqdm(policies, desc="policies", disable=not progress)]
