"""torch.distributed pieces of our own: expert parallelism (dispatch / combine, sharding, sharded
checkpoints) and a local launcher of gloo ranks."""

from .checkpoint import load_expert_parallel, load_pretrained, save_expert_parallel
from .expert import ExpertGroup, expert_group, expert_parallel

__all__ = ["ExpertGroup", "expert_group", "expert_parallel", "load_expert_parallel", "load_pretrained", "save_expert_parallel"]
