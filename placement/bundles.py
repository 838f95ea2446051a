"""Placement-group bundles per replica and the logical devices each replica owns.

One bundle per rank: `{"CPU": k}` on CPU, `{"GPU": 1, "CPU": k}` on CUDA. A replica is one
placement group (STRICT_PACK by default: all its ranks on one node, so its collectives stay
on the node's fast links). Replicas are separate placement groups, so Ray is free to put them on
different nodes; `spread_replicas` asks for that explicitly.

Devices: `devices=(0, 1, 2, 3)` with 2 ranks per replica gives replica 0 devices (0, 1) and
replica 1 devices (2, 3). They are logical indices in the launching process's visible order,
so they compose with CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class ReplicaPlan:
    """Everything needed to start one replica: its bundles, strategy and devices."""

    index: int
    bundles: tuple[dict[str, float], ...]
    strategy: str
    devices: tuple[int, ...] | None  # logical device per rank, or None (Ray assigns)

    @property
    def world_size(self) -> int:
        return len(self.bundles)


def assign_devices(devices: tuple[int, ...] | None, replica_count: int,
                   ranks_per_replica: int) -> list[tuple[int, ...] | None]:
    """Split `devices` into consecutive runs of `ranks_per_replica`, one run per replica.

    >>> assign_devices((0, 1, 2, 3), 2, 2)
    [(0, 1), (2, 3)]
    """
    if devices is None:
        return [None] * replica_count
    need = replica_count * ranks_per_replica
    if len(devices) != need:
        raise ValueError(
            f"devices={tuple(devices)} lists {len(devices)} devices but {replica_count} replica(s) x "
            f"{ranks_per_replica} rank(s) need exactly {need}; list one device per rank")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices={tuple(devices)} repeats a device; each rank needs its own device")
    return [tuple(devices[i * ranks_per_replica:(i + 1) * ranks_per_replica]) for i in range(replica_count)]


def rank_bundle(use_gpu: bool, cpus_per_rank: float) -> dict[str, float]:
    """The resources of one rank."""
    bundle = {"CPU": float(cpus_per_rank)}
    if use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def plan_replicas(*, ranks_per_replica: int, replica_count: int, use_gpu: bool, cpus_per_rank: float = 1.0,
                  strategy: str = "STRICT_PACK", devices: tuple[int, ...] | None = None) -> list[ReplicaPlan]:
    """The placement plan of every replica, in replica order."""
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if cpus_per_rank <= 0 and not use_gpu:
        raise ValueError(f"cpus_per_rank={cpus_per_rank} leaves a CPU rank without resources; use > 0")
    bundle = rank_bundle(use_gpu, cpus_per_rank)
    per_replica = assign_devices(devices, replica_count, ranks_per_replica)
    return [ReplicaPlan(i, tuple(dict(bundle) for _ in range(ranks_per_replica)), strategy, per_replica[i])
            for i in range(replica_count)]


def describe_plan(plans: list[ReplicaPlan]) -> str:
    """Human-readable plan, one line per replica."""
    lines = []
    for p in plans:
        dev = f" devices={list(p.devices)}" if p.devices is not None else ""
        lines.append(f"replica {p.index}: {p.world_size} rank(s), {p.strategy}, bundle={p.bundles[0]}{dev}")
    return "\n".join(lines)
