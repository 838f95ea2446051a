"""What crosses the Ray boundary between the driver and a rank actor: small frozen dataclasses.

    driver --RankSpec--> RankActor.setup        where and how one rank starts
    driver <--ActorInfo-- RankActor.info        where the actor landed (before ranks are assigned)
    driver --(seq, kind, payload, reply_value)--> RankActor.execute --RankReply--> driver   (actor calls)
    driver --LaneRequest--> rank's socket thread --RankReply--> driver                (same-node sockets)
    driver --LaneRequest--> RankActor.run_compiled --RankReply--> driver              (compiled graph)

A non-output rank replies with `value=None` unless the driver asked for every rank's value
(`collective_rpc(..., all_ranks=True)`), so nothing large travels back from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# RankReply.status: ran; the per-rank model lacks the method; raised (compiled graph only: `value` is the
# exception, since a compiled graph's channel carries replies, not Ray task errors)
OK, MISSING, ERROR = "ok", "missing", "error"


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
    engine_node: str | None = None  # node id of the engine that starts this rank
    launcher_devices: str | None = None  # the engine's CUDA_VISIBLE_DEVICES (None: it sees every GPU)


@dataclass(frozen=True)
class RankReply:
    seq: int
    rank: int
    status: str
    value: Any = None

    def matches(self, seq: int, rank: int) -> bool:
        return self.seq == seq and self.rank == rank and self.status in (OK, MISSING, ERROR)


@dataclass(frozen=True)
class LaneRequest:
    """One request or rpc on a replica's request lane (every rank gets the same message).

    Same-node sockets: `payload` is pickled once (large tensors in shared memory) and written to
    every rank's socket. Compiled graph: it travels by value through the shared-memory channel
    (written once, read by every rank), or as one `ray.put` reference when large. `window` is how
    many messages the driver had sent and not yet seen answered when it sent this one (this one
    included): the lane holds them for the rank, so it reports it as the calls it held
    (`RankActor.held`).
    """

    seq: int
    kind: str
    payload: Any
    reply_ranks: frozenset[int]
    window: int
