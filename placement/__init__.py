"""Pure placement planning: rank -> named groups, bundles per replica, device assignment.

Nothing here imports Ray or starts anything; every function is table-testable.
"""

from placement.topology import GROUP_NAMES, Topology
from placement.bundles import ReplicaPlan, assign_devices, plan_replicas

__all__ = ["GROUP_NAMES", "Topology", "ReplicaPlan", "assign_devices", "plan_replicas"]
