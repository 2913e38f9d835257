"""Cluster-scale simulation of the paper's evaluation (§VI): BaGuaLu-2 and static baselines on
every pipeline rank of a Table II preset, over one seeded routing-spike trace, calling the same
planner code as the runtime. Pure: no torch. Everything it reports is simulated."""

from .pipeline import iteration_time, p2p_seconds
from .run import Outcome, Simulation, mfu, model_flops_per_token, simulate
from .systems import SYSTEMS
from .trace import Trace, read_trace, routing_trace

__all__ = [
    "SYSTEMS", "Outcome", "Simulation", "Trace", "iteration_time", "mfu", "model_flops_per_token", "p2p_seconds", "read_trace",
    "routing_trace", "simulate",
]
