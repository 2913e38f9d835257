"""bagualu-plugin: adaptive activation-memory provisioning for MoE training (BaGuaLu-2, SC26).

Public API (DESIGN.md section 4); everything else is internal.
"""

from .config import Recipe, RecipeError, load_recipe
from .costmodel import CostModel, ModelDims, OpId, Parallel
from .hardware import HardwareSpec

__version__ = "0.1.0"

__all__ = ["CostModel", "HardwareSpec", "ModelDims", "OpId", "Parallel", "Recipe", "RecipeError", "load_recipe"]
