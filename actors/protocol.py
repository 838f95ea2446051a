"""What crosses the Ray boundary between the driver and a rank actor: small frozen dataclasses.

    driver --RankSpec--> RankActor.setup        where and how one rank starts
    driver <--ActorInfo-- RankActor.info        where the actor landed (before ranks are assigned)
    driver --(seq, kind, payload, reply_value)--> RankActor.execute --RankReply--> driver

A non-output rank replies with `value=None` unless the driver asked for every rank's value
(`collective_rpc(..., all_ranks=True)`), so nothing large travels back from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OK, MISSING = "ok", "missing"  # RankReply.status: ran, or the per-rank model lacks the method


@dataclass(frozen=True)
class ActorInfo:
    node_id: str
    ip: str
    pid: int
    gpu_ids: tuple[str, ...]
    placement_group_id: str | None = None


@dataclass(frozen=True)
class RankSpec:
    rank: int
    replica_index: int
    entry: Any
    plugin_args: dict[str, Any]
    parallel: Any
    params_dtype: str
    device_type: str
    visible_device: str | None
    master_addr: str
    master_port: int
    startup_timeout_s: float
    collective_timeout_s: float


@dataclass(frozen=True)
class RankReply:
    seq: int
    rank: int
    status: str
    value: Any = None

    def matches(self, seq: int, rank: int) -> bool:
        return self.seq == seq and self.rank == rank and self.status in (OK, MISSING)
