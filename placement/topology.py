"""Rank -> coordinates -> named groups of one replica, as pure index math.

Rank order, outermost first (tensor parallel innermost, so TP ranks are contiguous):

    rank = (pp * cfg_size + cfg) * D + d           D = ranks of one pipeline/CFG partition
    dense:      d = dense_dp * dense_tp_size + dense_tp
    attention:  d = (attention_dp * cp_size + attention_cp) * attention_tp_size + attention_tp
    moe:        d = (moe_dp * ep_size + moe_ep) * moe_tp_size + moe_tp

A group of axis `a` is every rank that shares all coordinates except `a`, ordered by `a`.
Worked example, 8 ranks, TP=2, PP=4 (D=2, cfg=1):
    dense_tp groups: [0,1] [2,3] [4,5] [6,7]      pp groups: [0,2,4,6] [1,3,5,7]
With PP=2, CFG=2, TP=2 (8 ranks): tp [0,1] [2,3] [4,5] [6,7], cfg [0,2] [1,3] [4,6] [5,7],
pp [0,4] [1,5] [2,6] [3,7]. The output rank is the first rank of the last stage, CFG branch 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any

GROUP_NAMES = ("world", "pp", "cfg", "dense_tp", "dense_dp", "attention_tp", "attention_cp",
               "attention_dp", "moe_tp", "moe_ep", "moe_dp")

# Inner axes of each domain, outermost first; their sizes come from `parallel.<domain>.<axis>_size`.
_DOMAIN_AXES = {"dense": ("dp", "tp"), "attention": ("dp", "cp", "tp"), "moe": ("dp", "ep", "tp")}


@dataclass(frozen=True)
class Topology:
    """The named-group layout of one replica, computed from a `ParallelConfig`."""

    pp_size: int
    cfg_size: int
    domains: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]  # (domain, ((axis, size), ...))

    @classmethod
    def from_parallel(cls, parallel: Any) -> "Topology":
        domains = tuple(
            (d, tuple((a, getattr(getattr(parallel, d), f"{a}_size")) for a in axes))
            for d, axes in _DOMAIN_AXES.items())
        return cls(parallel.outer.pp_size, parallel.outer.cfg_size, domains)

    @cached_property
    def domain_ranks(self) -> int:
        return _prod(size for _, size in self.domains[0][1])

    @cached_property
    def world_size(self) -> int:
        return self.pp_size * self.cfg_size * self.domain_ranks

    @cached_property
    def output_rank(self) -> int:
        """First rank of the last pipeline stage (CFG branch 0, domain rank 0)."""
        return (self.pp_size - 1) * self.cfg_size * self.domain_ranks

    def _mesh(self, name: str) -> tuple[tuple[int, ...], int]:
        """Shape of the mesh that holds axis `name`, and the axis index."""
        if name in ("pp", "cfg"):
            return (self.pp_size, self.cfg_size, self.domain_ranks), ("pp", "cfg").index(name)
        domain, _, axis = name.partition("_")
        axes = dict(self.domains)[domain]
        names = [a for a, _ in axes]
        return (self.pp_size, self.cfg_size, *(s for _, s in axes)), 2 + names.index(axis)

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """Every group of axis `name`, a partition of `range(world_size)`."""
        if name not in GROUP_NAMES:
            raise KeyError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}")
        if name == "world":
            return [tuple(range(self.world_size))]
        shape, axis = self._mesh(name)
        return _axis_groups(shape, axis)

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The members of rank's group `name`, in group-rank order."""
        self._check_rank(rank)
        return next(g for g in self.groups(name) if rank in g)

    def rank_groups(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Every named group of `rank`: {"world": (...), "pp": (...), ...}."""
        return {name: self.group_of(name, rank) for name in GROUP_NAMES}

    def coords(self, rank: int) -> dict[str, int]:
        """Rank's index along every axis, e.g. {"pp": 1, "cfg": 0, "dense_tp": 1, ...}."""
        return {name: self.group_of(name, rank).index(rank) for name in GROUP_NAMES}

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this replica's world of {self.world_size} ranks")


def _axis_groups(shape: tuple[int, ...], axis: int) -> list[tuple[int, ...]]:
    """Row-major mesh of `shape`; one group per index of the other axes, varying `axis`."""
    strides = [_prod(shape[i + 1:]) for i in range(len(shape))]
    others = [range(n) if i != axis else range(1) for i, n in enumerate(shape)]
    groups = []
    for index in itertools.product(*others):
        base = sum(i * s for i, s in zip(index, strides))
        groups.append(tuple(base + k * strides[axis] for k in range(shape[axis])))
    return groups


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
