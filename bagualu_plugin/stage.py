"""The pipeline stage a recipe describes, in numbers: its cost model, the usable capacity, the
non-activation bytes, the minimum per-micro-batch budget M0, the warmup depth, the 1F1B schedule
and the micro-batch costs of an iteration (paper §IV-A, §V-A). Every caller reads these numbers
here, so the Provisioner, the demo's static policies and `bagualu curve` judge against the same.

With `pipeline.vp` > 1 (interleaved 1F1B, §VI-A) the rank holds vp model chunks and each forward
runs one of them: `chunk(c)` is the stage as chunk c's forwards see it (same device, same
static bytes, chunk c's cost model), and the budgets count chunk forwards."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .config import Recipe
from .costmodel import CostModel, Curve, Forward, MicroBatchCost, MitigationOptions, OpId, iteration_curve
from .costmodel.graph import EXPERT_OPS
from .costmodel.pipeline import Step, interleaved_one_f_one_b, release_order, warmup_depth
from .planner import BudgetState
from .planner.gate import escalated
from .planner.greedy import InfeasibleBudget, plan_micro_batch


def _floor(chunks: Sequence[CostModel], tokens: int, recipe: Recipe) -> int:
    """M0: the least one forward of `tokens` can keep at `spike_max_imbalance`, or the
    expert-parallel group's size if smaller (vp > 1: the largest chunk's). With recompute allowed,
    full recompute with the all-to-alls, the floor every gate can reach whatever the routing
    (under expert parallelism together: nothing per routed pair). Without it, the end of
    Algorithm 2's path over the allowed strategies with every gate's escalation, and the room its
    backward needs to bring offloaded copies back: planning below that plans what cannot fit."""
    # no rank receives more than every rank's pairs: on one device routing never spikes
    routed = tokens * chunks[0].pairs_per_token * min(recipe.spikes.spike_max_imbalance, recipe.parallel.ep)
    allowed, seq_len = recipe.strategies.allowed, recipe.batch.seq_len

    def least(c: CostModel) -> float:
        if "recompute" in allowed:
            return c.footprint(Forward(tokens, seq_len, routed), c.full_recompute(collective=True)).device_bytes
        options, pairs = mitigation_options(recipe), [routed] * len(c.moe_layers)
        try:
            plan = plan_micro_batch(c, 0, tokens, pairs, seq_len, allowed, options).plan
        except InfeasibleBudget as error:
            plan = error.best.plan
        for layer in c.moe_layers:  # and every gate escalated, as gates do whatever the strategies
            plan = escalated(plan, layer, c.blocks[layer].collective or EXPERT_OPS)
        return c.footprint(Forward(tokens, seq_len, pairs), plan, options).needed_bytes

    return max(math.ceil(least(c)) for c in chunks)


@dataclass(frozen=True)
class Stage:
    recipe: Recipe
    cost: CostModel  # the blocks held by pipeline.rank (of `chunk(c)`: chunk c's)
    tokens: int  # tokens per micro-batch, T
    static_bytes: int  # weights, gradients, optimizer state of the whole rank
    min_budget: int  # M0: the floor (`_floor`): one forward under full recompute with the all-to-alls (vp > 1: largest chunk's)
    chunks: tuple[CostModel, ...]  # the rank's model chunks, vp of them (vp = 1: the rank's blocks)

    @classmethod
    def of(cls, recipe: Recipe, cost: CostModel | None = None, split: bool = True, static_bytes: int | None = None) -> Stage:
        """`cost`: a whole-model cost model (e.g. profiled; default: analytic from the recipe),
        split to the recipe's pipeline stage, or already the stage's own when `split` is False
        (the model a pipeline rank holds is its stage). `static_bytes`: the non-activation bytes
        measured on a live model (`runtime.static_memory`), instead of the recipe's."""
        par, pipe, budget = recipe.parallel, recipe.pipeline, recipe.budget
        if pipe.vp > 1 and not split:
            raise ValueError(
                f"pipeline.vp={pipe.vp}: a rank's own model (split=False, as the Provisioner gets it) has no chunks to "
                "interleave, and the runtime engines run plain 1F1B; interleaved stages are planned from the whole "
                "model (Stage.of(recipe), `bagualu simulate`): use vp=1 to train"
            )
        whole = cost or CostModel.from_config(recipe.model, recipe.hardware, par)
        stage = whole.stage(pipe.pp, pipe.rank, pipe.vp) if split else whole
        chunks = tuple(whole.stage(pipe.pp, pipe.rank, pipe.vp, [c]) for c in range(pipe.vp)) if pipe.vp > 1 else (stage,)
        tokens = recipe.batch.tokens
        if static_bytes is not None:
            static = static_bytes
        elif budget.non_activation_bytes == "auto":
            # what the host keeps instead (offload) costs the device nothing
            trained = 0.0 if budget.offload_optimizer or budget.offload_params else budget.grad_bytes_per_param
            optimizer = 0.0 if budget.offload_optimizer or budget.offload_params else budget.optimizer_bytes_per_param
            if budget.fsdp:
                held = 0.0 if budget.offload_params else budget.weight_bytes_per_param  # per parameter, of the shards
                static = stage.fsdp_static_bytes(budget.weight_bytes_per_param, trained, optimizer, shards=par.dp, shard_bytes=held)
            else:
                static = stage.static_bytes(
                    budget.weight_bytes_per_param,
                    trained,
                    optimizer,
                    dense_shards=par.dp if budget.shard_optimizer else 1,
                    expert_shards=par.dp * par.tp // par.ep if budget.shard_optimizer else 1,
                    shard_gradients=budget.shard_gradients,
                )
        else:
            static = budget.non_activation_bytes
        if static_bytes is None:
            static += budget.engine_buffer_bytes  # what was measured, or a stage's own, holds them already
        m0 = _floor(chunks, tokens, recipe) if budget.min_budget == "auto" else budget.min_budget
        return cls(recipe, stage, tokens, static, m0, chunks)

    def chunk(self, c: int) -> Stage:
        """The stage as the forwards of model chunk `c` see it: chunk c's cost model, the rank's memory."""
        if not 0 <= c < len(self.chunks):
            raise ValueError(f"chunk must be in [0, {len(self.chunks)}) (pipeline.vp), got {c}")
        return replace(self, cost=self.chunks[c])

    @property
    def capacity(self) -> int:
        """M_max: the device bytes static memory and activations may use together, i.e. the
        hardware's capacity less `budget.reserve_bytes` (allocator, communication buffers)."""
        return self.recipe.hardware.capacity_bytes - self.recipe.budget.reserve_bytes

    @property
    def warmup(self) -> int:
        """B_w: forwards in flight at the stage's peak. 1F1B's first steady forward also runs
        before any backward, so rank r of P stacks min(P - r, m), one more than its warmup
        forwards; with vp > 1 they are chunk forwards (`warmup_depth`)."""
        pipe = self.recipe.pipeline
        return warmup_depth(pipe.pp, pipe.rank, pipe.micro_batches, pipe.vp)

    @property
    def schedule(self) -> list[Step]:
        """The forwards and backwards of one iteration on this rank, in nanotron's 1F1B order
        (vp > 1: Megatron-LM's interleaved order, every step one chunk)."""
        pipe = self.recipe.pipeline
        return interleaved_one_f_one_b(pipe.pp, pipe.rank, pipe.micro_batches, pipe.vp)

    def budgets(self) -> BudgetState:
        """Algorithm 1 before the iteration's first forward (§V-A), freeing in this schedule's order.
        A layout whose in-flight micro-batches do not fit even at M0, the floor every micro-batch
        can reach up to `spikes.spike_max_imbalance`, is refused here, before any training, with
        the rank, the numbers and what would fit (`fits`)."""
        short = self.static_bytes + self.warmup * self.min_budget - self.capacity
        if short > 0:
            pipe, fits = self.recipe.pipeline, self.fits()
            advice = f"; would fit: {' or '.join(fits)}" if fits else ""
            raise ValueError(
                f"pipeline rank {pipe.rank} of {pipe.pp}: capacity {self.capacity} bytes cannot hold static memory "
                f"{self.static_bytes} plus {self.warmup} in-flight micro-batches at the minimum M0 = {self.min_budget} "
                f"bytes ({short} bytes short; M0 is the least a forward of {', '.join(self.recipe.strategies.allowed) or 'no'} "
                f"mitigation keeps at any routing up to spike_max_imbalance "
                f"{self.recipe.spikes.spike_max_imbalance:g}){advice}. Lower the micro-batch size or sequence "
                "length, raise pipeline parallelism, or shard more state"
            )
        released = release_order(self.schedule) if self.recipe.pipeline.vp > 1 else None
        return BudgetState.start(self.capacity, self.static_bytes, self.min_budget, self.warmup, released)

    def fits(self) -> list[str]:
        """What would let this rank's in-flight micro-batches fit at M0: the longest sequence (a
        halving of `batch.seq_len`, at the same micro-batch size) or the largest micro-batch size
        under the given one; and, from the recipe's model, the fewest pipeline ranks above
        `pipeline.pp` whose every rank fits. Empty where M0 is the recipe's own number."""
        recipe, out = self.recipe, []
        if recipe.budget.min_budget != "auto":
            return out
        batch, room = recipe.batch, self.capacity - self.static_bytes
        shorter = [("micro_batch_size", n) for n in range(batch.micro_batch_size - 1, 0, -1)]
        shorter += [("seq_len", batch.seq_len >> k) for k in range(1, batch.seq_len.bit_length()) if batch.micro_batch_size == 1]
        for field, n in shorter:
            changed = recipe.model_copy(update={"batch": batch.model_copy(update={field: n})})
            m0 = _floor(self.chunks, changed.batch.tokens, changed)
            if self.warmup * m0 <= room:
                out.append(f"batch.{field} {n} (M0 {m0} bytes)")
                break
        pipe, layers = recipe.pipeline, recipe.model.num_layers
        for pp in range(pipe.pp + 1, layers // pipe.vp + 1):
            if layers % (pp * pipe.vp) or (pipe.vp > 1 and pipe.micro_batches % pp):
                continue
            try:
                stages = [
                    Stage.of(recipe.model_copy(update={"pipeline": pipe.model_copy(update={"pp": pp, "rank": r})})) for r in range(pp)
                ]
            except ValueError:  # a layout the recipe's other sections rule out
                continue
            if all(s.static_bytes + s.warmup * s.min_budget <= s.capacity for s in stages):
                out.append(f"pipeline.pp {pp}")
                break
        return out

    @property
    def options(self) -> MitigationOptions:
        return mitigation_options(self.recipe)

    def micro_batch(self, imbalance: float = 1.0, plan: Mapping[OpId, str] | None = None) -> MicroBatchCost:
        """One micro-batch whose MoE layers receive `imbalance` x the balanced routed pairs."""
        routed = self.tokens * self.cost.pairs_per_token * imbalance
        return self.cost.micro_batch(Forward(self.tokens, self.recipe.batch.seq_len, routed), plan, self.options)

    def curve(self, imbalance: Sequence[float] | None = None) -> Curve:
        """The iteration curve with nothing mitigated; `imbalance[i]` scales micro-batch i's routing
        (in every chunk of it)."""
        pipe = self.recipe.pipeline
        m = pipe.micro_batches
        imbalance = list(imbalance or [1.0] * m)
        if len(imbalance) != m:
            raise ValueError(f"imbalance has {len(imbalance)} entries, expected pipeline.micro_batches = {m}")
        chunks = [self.chunk(c) for c in range(pipe.vp)]
        costs = {(x, c): chunk.micro_batch(x) for x in set(imbalance) for c, chunk in enumerate(chunks)}
        ordered = [costs[x, c] for x in imbalance for c in range(pipe.vp)]
        return iteration_curve(ordered, pipe.pp, pipe.rank, self.static_bytes, pipe.vp)


def mitigation_options(recipe: Recipe) -> MitigationOptions:
    """The knobs of the recipe's strategies, as the cost model and the runtime take them."""
    s = recipe.strategies
    return MitigationOptions(fp8_block_size=s.fp8.block_size, offload_min_bytes=s.offload.min_bytes, loss_chunk_tokens=s.loss_chunk_tokens)
