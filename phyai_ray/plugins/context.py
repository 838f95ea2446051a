"""`RankContext`: what a plugin's `create(plugin_args, ctx)` learns about its rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phyai_ray.process_groups import GroupSet


@dataclass(frozen=True)
class RankContext:
    """Rank, replica, device and topology of the rank a plugin model is built on."""

    rank: int
    world_size: int
    replica_index: int
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    parallel: Any  # ParallelConfig
    groups: GroupSet = field(repr=False)
    local_rank: int = 0
    node_id: str | None = None

    @property
    def is_output_rank(self) -> bool:
        """Whether this rank's `step` result is the replica's result."""
        return self.rank == self.groups.topology.output_rank

    def group_rank(self, name: str) -> int:
        """This rank's index inside group `name` (e.g. "dense_tp")."""
        return self.groups.group_rank(name)

    def group_size(self, name: str) -> int:
        """Number of ranks in group `name`."""
        return self.groups.size(name)

    def group_members(self, name: str) -> tuple[int, ...]:
        """Replica ranks in group `name`, in group-rank order."""
        return self.groups.members[name]
