"""Decisions of paper §V-A: the pipeline-aware budget of each micro-batch (Algorithm 1), the
per-operator mitigation that fits it (Algorithm 2) and the decision at each MoE gate (deferred
planning)."""

from .budget import BudgetState
from .gate import GateDecision, GatePlan, LayerCost, at_gate, escalated, gate_costs, plan_for_gates
from .greedy import Decision, InfeasibleBudget, greedy_path, plan_micro_batch
from .path import PathPlanner

__all__ = [
    "BudgetState", "Decision", "GateDecision", "GatePlan", "InfeasibleBudget", "LayerCost", "PathPlanner", "at_gate",
    "escalated", "gate_costs", "greedy_path", "plan_for_gates", "plan_micro_batch",
]
