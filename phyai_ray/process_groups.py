"""The named process groups of one rank, and which set is active in this process.

`GroupSet` maps every group name of the topology (`world`, `pp`, `dense_tp`, ...) to its members
and, for groups larger than one rank, a torch.distributed process group. All ranks build the
process groups in the same order (every distinct member tuple of every name, deduplicated), which
`torch.distributed.new_group` requires.

The active set is looked up per context first (an inline engine runs its plugin with a world of
one), then per process (a rank actor or torchrun process installs its set once).
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from placement.topology import GROUP_NAMES, Topology

logger = logging.getLogger(__name__)

_ACTIVE: contextvars.ContextVar["GroupSet | None"] = contextvars.ContextVar("phyai_ray_groups", default=None)
_PROCESS: list["GroupSet | None"] = [None]


class GroupSet:
    """Members and process groups of every named group of one rank."""

    def __init__(self, topology: Topology, rank: int, handles: dict[str, Any] | None = None,
                 backend: str | None = None) -> None:
        self.topology, self.rank, self.backend = topology, rank, backend
        self.members = topology.rank_groups(rank)
        self.handles = handles or {}

    @classmethod
    def single(cls, topology: Topology | None = None) -> "GroupSet":
        """A world of one rank: every group is the identity, no torch.distributed needed."""
        if topology is None:
            topology = Topology(1, 1, (("dense", (("dp", 1), ("tp", 1))),
                                       ("attention", (("dp", 1), ("cp", 1), ("tp", 1))),
                                       ("moe", (("dp", 1), ("ep", 1), ("tp", 1)))))
        if topology.world_size != 1:
            raise ValueError(f"GroupSet.single needs a 1-rank topology, got {topology.world_size} ranks")
        return cls(topology, 0)

    @classmethod
    def build(cls, topology: Topology, rank: int, backend: str, timeout_s: float | None = None) -> "GroupSet":
        """Create the process groups (collective: every rank of the replica must call this).

        `timeout_s` bounds every collective on them (the replica's collective_timeout_s).
        """
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None

        made: dict[tuple[int, ...], Any] = {}
        for name in GROUP_NAMES[1:]:
            for ranks in topology.groups(name):
                if len(ranks) > 1 and ranks != tuple(range(topology.world_size)) and ranks not in made:
                    made[ranks] = dist.new_group(list(ranks), timeout=timeout)
        members = topology.rank_groups(rank)
        handles = {n: (dist.group.WORLD if m == tuple(range(topology.world_size)) else made.get(m))
                   for n, m in members.items() if len(m) > 1}
        return cls(topology, rank, handles, backend)

    def destroy(self) -> None:
        """Destroy the process groups this set built (not the default world)."""
        import torch.distributed as dist

        built = {id(h): h for h in self.handles.values() if h is not None and h is not dist.group.WORLD}
        for handle in built.values():
            dist.destroy_process_group(handle)
        self.handles = {}

    def size(self, name: str) -> int:
        return len(self._members(name))

    def group_rank(self, name: str) -> int:
        return self._members(name).index(self.rank)

    def global_rank(self, name: str, group_rank: int) -> int:
        members = self._members(name)
        if not 0 <= group_rank < len(members):
            raise ValueError(f"group rank {group_rank} is outside group {name!r} of size {len(members)}")
        return members[group_rank]

    def handle(self, name: str) -> Any:
        self._members(name)
        if name not in self.handles:
            raise RuntimeError(f"group {name!r} has {self.size(name)} ranks but no process group was built; "
                               "torch.distributed is not initialised in this process")
        return self.handles[name]

    def _members(self, name: str) -> tuple[int, ...]:
        try:
            return self.members[name]
        except KeyError:
            raise KeyError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}") from None

    def activate(self) -> "_Activation":
        """Make this set the one `P` uses in the current context (`with groups.activate(): ...`)."""
        return _Activation(self)

    def install(self) -> None:
        """Make this set the process-wide default (one rank per process)."""
        _PROCESS[0] = self


class _Activation:
    """The context manager of `GroupSet.activate` (a class, not a generator: it runs on every step)."""

    __slots__ = ("groups", "token")

    def __init__(self, groups: GroupSet) -> None:
        self.groups = groups

    def __enter__(self) -> GroupSet:
        self.token = _ACTIVE.set(self.groups)
        return self.groups

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self.token)


def activate_groups(groups: GroupSet) -> contextvars.Token:
    """`groups.activate().__enter__()` for the per-step path; hand the token to `deactivate_groups`."""
    return _ACTIVE.set(groups)


def deactivate_groups(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)


def active() -> GroupSet:
    """The group set of the running plugin; a world of one when none is installed."""
    current = _ACTIVE.get() or _PROCESS[0]
    return current if current is not None else _SINGLE


def uninstall() -> None:
    _PROCESS[0] = None


_SINGLE = GroupSet.single()
