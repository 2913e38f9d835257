"""One demo rank's model, recipe, cost model, stage and batches, and the training step every policy
shares. Each rank holds its share of the routed experts (`expert_parallel`) and its own batches;
every policy starts from the same weights, a few steps into training (`pretrained`)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from ..adapters import tiny_model
from ..adapters.costs import DTYPES
from ..config import Recipe
from ..costmodel import CostModel, ModelDims
from ..parallel.expert import expert_parallel
from ..parallel.gradients import average_gradients
from ..runtime.driver import run_iteration
from ..runtime.profiler import profile
from ..stage import Stage

LEARNING_RATE = 1e-3  # AdamW's
PRETRAIN_STEPS = 5
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}  # a recipe's dtype names


def demo_model(dims: ModelDims, seed: int = 0, device: torch.device | None = None):
    """A random-init GLM-4-MoE with the recipe's dimensions and dtype (tiny by design), running the
    "bagualu" experts implementation (what `expert_parallel` needs), made on `device` (None: torch's
    default, the CPU)."""
    with torch.device(device) if device is not None else nullcontext():
        model = tiny_model(
            "glm4_moe",
            seed=seed,
            dtype=TORCH_DTYPES[dims.dtype],
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


def rank_model(dims: ModelDims, seed: int = 0, device: torch.device | None = None):
    """This rank's demo model: the seeded model (the same on every rank), its routed experts
    sharded over the world group, on `device` (None: the CPU)."""
    model = demo_model(dims, seed, device)
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


def rank_batches(recipe: Recipe, rank: int, seed: int = 0) -> list[torch.Tensor]:
    """Rank `rank`'s micro-batches of token ids (its own, seeded by `seed` and the rank)."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    batch = recipe.batch
    return [
        torch.randint(0, recipe.model.vocab_size, (batch.micro_batch_size, batch.seq_len), generator=generator)
        for _ in range(recipe.pipeline.micro_batches)
    ]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The end of every iteration, the same under every policy (and not timed): gradients averaged
    over the ranks (data parallelism, dp = ep), then an AdamW step, so the router trains and
    routing evolves as in training."""
    average_gradients(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def pretrained(stage: Stage, batches: Sequence[torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """This rank's weights every policy starts from: the seeded model after `PRETRAIN_STEPS`
    steps of plain training on every rank's batches (every rank at once). The random-init router
    routes unevenly (measured: rank 0 receives 1.11x its balanced share in the first iteration)
    and the first steps of training take most of that away (within 5% after them); starting past
    them, the memory the policies meet follows the spike schedule, as in the paper. The model is
    made on the batches' device."""
    model = rank_model(stage.recipe.model, seed, batches[0].device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for _ in range(PRETRAIN_STEPS):
        run_iteration(model, batches, stage.schedule)
        train_step(model, optimizer)
    return model.state_dict()
