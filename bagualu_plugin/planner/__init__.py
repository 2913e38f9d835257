"""Decisions of paper §V-A: the pipeline-aware budget of each micro-batch (Algorithm 1), the
per-operator mitigation that fits it (Algorithm 2) and the decision at each MoE gate (deferred
planning)."""

from .budget import BudgetState
from .gate import GateDecision, GatePlan, LayerCost, at_gate, escalated, gate_costs, plan_for_gates
from .greedy import CachedPlanner, Decision, InfeasibleBudget, plan_micro_batch

__all__ = [
    "BudgetState", "CachedPlanner", "Decision", "GateDecision", "GatePlan", "InfeasibleBudget", "LayerCost", "at_gate", "escalated",
    "gate_costs", "plan_for_gates", "plan_micro_batch",
]
