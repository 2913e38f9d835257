"""HF MoE families taken apart into the operators of docs/architecture.md: one code path over the
family traits table, op-scope tracking, gate-time hooks and the registered "bagualu" experts
implementation."""

from ..families import FAMILIES, FamilyTraits
from .adapter import Adapter, Layer, UnsupportedModelError, is_inside_backward, list_ops, shared_arguments, unwrap
from .experts import IMPLEMENTATION, bagualu_experts_forward, local_expert_range
from .scopes import OpTracker, enter_expert_op
from .tiny import TINY_CONFIGS, save_tiny, tiny_config, tiny_model

__all__ = [
    "FAMILIES", "IMPLEMENTATION", "TINY_CONFIGS", "Adapter", "FamilyTraits", "Layer", "OpTracker", "UnsupportedModelError",
    "enter_expert_op", "bagualu_experts_forward", "is_inside_backward", "list_ops", "shared_arguments",
    "local_expert_range", "save_tiny", "tiny_config", "tiny_model", "unwrap",
]
