"""The runtime mechanisms: ledger, saved-tensor hooks, recompute, provisioner.

All torch state of the system lives here (docs/architecture.md); the planner only sees numbers.
"""

from .ledger import Ledger, Record, SimulatedOutOfMemoryError

__all__ = ["Ledger", "Record", "SimulatedOutOfMemoryError"]
