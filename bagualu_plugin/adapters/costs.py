"""The analytic cost model of a supported HF model, and the §V-A conflicts of a plan on it: the
model's config, dtype and attention kernel read off the model (its graphs name the same tensors
the model saves; benchmarks/costmodel_accuracy.py checks it)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..costmodel import CostModel, ModelDims
from ..costmodel.conflicts import Conflict, conflicts
from ..costmodel.plan import Plan
from ..hardware import HardwareSpec
from .adapter import Adapter


def model_cost(model: nn.Module, hardware: HardwareSpec | str = "cpu") -> CostModel:
    """The analytic cost model of a supported HF model on `hardware` (a preset name or a spec,
    e.g. a recipe's `hardware`), in the model's dtype and attention kernel."""
    adapter = Adapter(model)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[next(adapter.model.parameters()).dtype]
    dims = ModelDims.from_hf_config(adapter.config, dtype=dtype, attention=adapter.config._attn_implementation)
    return CostModel.from_config(dims, hardware)


def find_conflicts(plan: Mapping, model: nn.Module | CostModel) -> list[Conflict]:
    """`bgl.find_conflicts`: the §V-A conflicts of `plan` on a supported HF model (its analytic
    cost model names the same tensors the model saves) or on a cost model."""
    return conflicts(plan if isinstance(plan, Plan) else Plan(plan), model if isinstance(model, CostModel) else model_cost(model))
