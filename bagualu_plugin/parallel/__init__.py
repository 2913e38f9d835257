"""torch.distributed pieces of our own: expert parallelism (sharding, dispatch / combine) and
checkpoints that each rank loads with only its experts."""

from .checkpoint import load_expert_parallel, save_expert_parallel
from .expert import expert_group, expert_parallel

__all__ = ["expert_group", "expert_parallel", "load_expert_parallel", "save_expert_parallel"]
