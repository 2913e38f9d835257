"""bagualu-plugin: adaptive activation-memory provisioning for MoE training (BaGuaLu-2, SC26).

Public API (docs/architecture.md); everything else is internal. Importing the package registers
the "bagualu" experts implementation with transformers, so
`from_pretrained(..., experts_implementation="bagualu")` works after `import bagualu_plugin`.
"""

from .adapters import list_ops
from .adapters.costs import find_conflicts
from .config import Recipe, RecipeError, load_recipe
from .costmodel import CostModel, ModelDims, OpId, Parallel
from .costmodel.plan import Plan
from .derive import derive_recipe
from .hardware import HardwareSpec
from .parallel import expert_parallel
from .runtime.plan_runtime import apply_plan
from .runtime.profiler import profile
from .runtime.provisioner import apply
from .versions import warn_untested

__version__ = "0.1.0"

warn_untested()  # once: a module's body runs once per process

__all__ = [
    "CostModel", "HardwareSpec", "ModelDims", "OpId", "Parallel", "Plan", "Recipe", "RecipeError",
    "apply", "apply_plan", "derive_recipe", "expert_parallel", "find_conflicts", "list_ops", "load_recipe", "profile",
]
