"""The pipeline stage a recipe describes, in numbers: its cost model, the usable capacity, the
non-activation bytes, the minimum per-micro-batch budget M0, the warmup depth, the 1F1B schedule
and the micro-batch costs of an iteration (paper §IV-A, §V-A). Every caller reads these numbers
here, so the Provisioner, the demo's static policies and `bagualu curve` judge against the same."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .config import Recipe
from .costmodel import CostModel, Curve, MicroBatchCost, MitigationOptions, OpId, iteration_curve
from .costmodel.pipeline import Step, one_f_one_b, warmup_depth


@dataclass(frozen=True)
class Stage:
    recipe: Recipe
    cost: CostModel  # the blocks held by pipeline.rank
    tokens: int  # tokens per micro-batch, T
    static_bytes: int  # weights, gradients, optimizer state
    min_budget: int  # M0: activation bytes of one micro-batch under full recompute

    @classmethod
    def of(cls, recipe: Recipe, cost: CostModel | None = None, split: bool = True) -> Stage:
        """`cost`: a whole-model cost model (e.g. profiled; default: analytic from the recipe),
        split to the recipe's pipeline stage, or already the stage's own when `split` is False
        (the model a pipeline rank holds is its stage)."""
        par, pipe, budget = recipe.parallel, recipe.pipeline, recipe.budget
        if pipe.vp > 1:
            raise ValueError(
                f"pipeline.vp={pipe.vp}: a stage is budgeted per whole-rank micro-batch (its cost split by contiguous layers, "
                "M0, Algorithm 1 freeing forward i - B_w before forward i, the Provisioner keyed by micro-batch); interleaved "
                "chunks free in another order (costmodel.pipeline.interleaved_one_f_one_b) and are not budgeted: use vp=1"
            )
        whole = cost or CostModel.from_config(recipe.model, recipe.hardware, par)
        stage = whole.stage(pipe.pp, pipe.rank) if split else whole
        tokens = recipe.batch.tokens
        if budget.non_activation_bytes == "auto" and budget.fsdp:
            static = stage.fsdp_static_bytes(
                budget.weight_bytes_per_param, budget.grad_bytes_per_param, budget.optimizer_bytes_per_param, shards=par.dp
            )
        elif budget.non_activation_bytes == "auto":
            static = stage.static_bytes(
                budget.weight_bytes_per_param,
                budget.grad_bytes_per_param,
                budget.optimizer_bytes_per_param,
                dense_shards=par.dp if budget.shard_optimizer else 1,
                expert_shards=par.dp * par.tp // par.ep if budget.shard_optimizer else 1,
            )
        else:
            static = budget.non_activation_bytes
        m0 = budget.min_budget
        if m0 == "auto":
            m0 = stage.activation_bytes(tokens, seq_len=recipe.batch.seq_len, plan=stage.full_recompute())
        return cls(recipe, stage, tokens, static, m0)

    @property
    def capacity(self) -> int:
        """M_max: the device bytes static memory and activations may use together, i.e. the
        hardware's capacity less `budget.reserve_bytes` (allocator, communication buffers)."""
        return self.recipe.hardware.capacity_bytes - self.recipe.budget.reserve_bytes

    @property
    def warmup(self) -> int:
        """B_w: micro-batches in flight at the stage's peak. 1F1B's first steady forward also runs
        before any backward, so rank r of P stacks min(P - r, m), one more than its warmup forwards."""
        pipe = self.recipe.pipeline
        return warmup_depth(pipe.pp, pipe.rank, pipe.micro_batches)

    @property
    def schedule(self) -> list[Step]:
        """The forwards and backwards of one iteration on this rank, in nanotron's 1F1B order."""
        pipe = self.recipe.pipeline
        return one_f_one_b(pipe.pp, pipe.rank, pipe.micro_batches)

    @property
    def options(self) -> MitigationOptions:
        s = self.recipe.strategies
        return MitigationOptions(
            fp8_block_size=s.fp8.block_size, offload_min_bytes=s.offload.min_bytes, loss_chunk_tokens=s.loss_chunk_tokens
        )

    def micro_batch(self, imbalance: float = 1.0, plan: Mapping[OpId, str] | None = None) -> MicroBatchCost:
        """One micro-batch whose MoE layers receive `imbalance` x the balanced routed pairs."""
        routed = self.tokens * self.cost.pairs_per_token * imbalance
        return self.cost.micro_batch(self.tokens, routed, self.recipe.batch.seq_len, plan, self.options)

    def curve(self, imbalance: Sequence[float] | None = None) -> Curve:
        """The iteration curve with nothing mitigated; `imbalance[i]` scales micro-batch i's routing."""
        m = self.recipe.pipeline.micro_batches
        imbalance = list(imbalance or [1.0] * m)
        if len(imbalance) != m:
            raise ValueError(f"imbalance has {len(imbalance)} entries, expected pipeline.micro_batches = {m}")
        costs = {x: self.micro_batch(x) for x in set(imbalance)}
        pipe = self.recipe.pipeline
        return iteration_curve([costs[x] for x in imbalance], pipe.pp, pipe.rank, self.static_bytes)
