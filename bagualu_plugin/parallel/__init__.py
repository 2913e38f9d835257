"""torch.distributed pieces of our own: expert parallelism (dispatch / combine, sharding) and a
local launcher of gloo ranks."""

from .expert import ExpertGroup, expert_group, expert_parallel

__all__ = ["ExpertGroup", "expert_group", "expert_parallel"]
