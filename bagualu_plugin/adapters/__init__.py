"""HF MoE families taken apart into the operators of DESIGN.md section 4: the model_type table,
op-scope tracking, gate-time hooks and the registered "bagualu" experts implementation."""

from .adapter import FAMILIES, Adapter, Layer, UnsupportedModelError, is_inside_backward, list_ops, shared_arguments, unwrap
from .experts import IMPLEMENTATION, bagualu_experts_forward, local_expert_range, set_expert_parallel
from .family import Family
from .scopes import OpTracker, enter_expert_op
from .tiny import save_tiny, tiny_config, tiny_model

__all__ = [
    "FAMILIES", "IMPLEMENTATION", "Adapter", "Family", "Layer", "OpTracker", "UnsupportedModelError", "enter_expert_op",
    "bagualu_experts_forward", "is_inside_backward", "list_ops", "shared_arguments", "local_expert_range", "save_tiny",
    "set_expert_parallel", "tiny_config", "tiny_model", "unwrap",
]
