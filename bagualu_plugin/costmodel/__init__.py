"""Activation memory modelling (paper §IV): operator graphs, per-op costs linear in the load,
mitigation costs from the roofline of each strategy, and the iteration curve of a stage."""

from .dims import FAMILIES, LoraDims, MLADims, ModelDims, Parallel, param_count
from .forward import Forward, ForwardKind
from .graph import LAYER_OPS, BlockGraph, OpId, OpSpec, TensorSpec
from .linear import LinearForm, Load
from .mitigation import MITIGATIONS, STRATEGIES, Footprint, MitigationOptions, footprint
from .model import CostModel, MitigationCost, OpCost
from .pipeline import (
    Curve,
    MicroBatchCost,
    Step,
    interleaved_one_f_one_b,
    iteration_curve,
    one_f_one_b,
    release_order,
    warmup_depth,
)
from .roofline import Roofline, crossover

__all__ = [
    "FAMILIES", "LAYER_OPS", "MITIGATIONS", "STRATEGIES", "BlockGraph", "CostModel", "Curve",
    "Footprint", "Forward", "ForwardKind", "LinearForm", "Load", "LoraDims", "MLADims", "MicroBatchCost", "MitigationCost",
    "MitigationOptions", "ModelDims", "OpCost", "OpId", "OpSpec", "Parallel", "Roofline", "Step",
    "TensorSpec", "crossover", "footprint", "interleaved_one_f_one_b", "iteration_curve", "one_f_one_b",
    "param_count", "release_order", "warmup_depth",
]
