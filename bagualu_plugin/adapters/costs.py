"""The analytic cost model of a supported HF model, and the §V-A conflicts of a plan on it: the
model's config, dtype and attention kernel read off the model (its graphs name the same tensors
the model saves; benchmarks/costmodel_accuracy.py checks it)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..costmodel import CostModel, ModelDims, Parallel
from ..costmodel.conflicts import Conflict, conflicts
from ..costmodel.plan import Plan
from ..hardware import HardwareSpec
from .adapter import Adapter


def model_cost(model: nn.Module, hardware: HardwareSpec | str = "cpu") -> CostModel:
    """The analytic cost model of a supported HF model on `hardware` (a preset name or a spec,
    e.g. a recipe's `hardware`), in the model's dtype and attention kernel, on this rank of its
    expert-parallel group (`bgl.expert_parallel`) if it has one."""
    adapter = Adapter(model)
    weight = next(adapter.model.parameters())
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[weight.dtype]
    dims = ModelDims.from_hf_config(adapter.config, dtype=dtype, attention=_attention_kernel(adapter, weight))
    group = adapter.expert_group
    parallel = Parallel(ep=group.size, ep_rank=group.rank, all_to_all=True) if group else Parallel()
    return CostModel.from_config(dims, hardware, parallel)


def _attention_kernel(adapter: Adapter, weight: torch.Tensor) -> str:
    """The attention the model really runs, as the cost model names it. On CUDA, torch dispatches
    FP32 SDPA with grouped-query attention (transformers passes `enable_gqa`) to its math kernel,
    not a fused one (flash and cuDNN take half precision only): it keeps the (L x L) probabilities,
    a scaled q and the repeated k and v, the bytes eager attention keeps (seen on an H200 with
    torch 2.11; benchmarks/gpu_check.py checks it)."""
    config, kind = adapter.config, adapter.config._attn_implementation
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kind == "sdpa" and weight.is_cuda and weight.dtype == torch.float32 and kv_heads != heads:
        return "eager"
    return kind


def find_conflicts(plan: Mapping, model: nn.Module | CostModel) -> list[Conflict]:
    """`bgl.find_conflicts`: the §V-A conflicts of `plan` on a supported HF model (its analytic
    cost model names the same tensors the model saves) or on a cost model."""
    return conflicts(plan if isinstance(plan, Plan) else Plan(plan), model if isinstance(model, CostModel) else model_cost(model))
