"""Decisions of paper §V-A: the pipeline-aware budget of each micro-batch (Algorithm 1) and the
per-operator mitigation that fits it (Algorithm 2)."""

from .budget import BudgetState
from .greedy import CachedPlanner, Decision, InfeasibleBudget, plan_micro_batch

__all__ = ["BudgetState", "CachedPlanner", "Decision", "InfeasibleBudget", "plan_micro_batch"]
