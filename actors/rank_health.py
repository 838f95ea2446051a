"""`RankHealth`: how a Ray replica learns that a rank died or hangs, and the error that names it.

    health = RankHealth(group, interval_s=proc.liveness_interval_s, fail=executor_fail, failed=is_failed)
    health.watch()        liveness: a ping per rank on its control lane every interval_s; no answer for
                          max(10 s, 40 intervals) means stuck outside Python or unreachable
    health.stop()         the pings end (teardown)
    on_socket_broken / on_lane_broken   a lane broke -> the rank Ray knows dead, or the lane's cause
    rank_error / send_error             an EngineUnavailableError naming the replica, rank, node and cause

It reads the group's actors and nodes (actors/rank_group.py) and reports every failure it finds to
`fail`, the executor's one failure path (actors/ray_executor.py); `failed()` says whether the replica
already failed, so a second cause is not looked for.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import ray

from actors import fetch
from actors.rank_group import RankGroup
from phyai_ray.errors import EngineUnavailableError
from phyai_ray.work import Work

logger = logging.getLogger(__name__)


class RankHealth:
    """Dead and stuck ranks of one `RankGroup`, and the errors that name them."""

    def __init__(self, group: RankGroup, *, interval_s: float, fail: Callable[[EngineUnavailableError], None],
                 failed: Callable[[], bool]) -> None:
        self.group, self.index = group, group.index
        self.interval_s, self.hang_s = interval_s, max(10.0, 40 * interval_s)
        self._fail, self._failed = fail, failed
        self._stop = threading.Event()

    def watch(self) -> None:
        """Start the liveness pings (a daemon thread; it ends at `stop` or the first failure)."""
        threading.Thread(target=self._liveness_loop, name=f"phyai-replica-{self.index}-liveness", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def on_socket_broken(self, rank: int, exc: BaseException) -> None:
        """A rank's socket closed or carried garbage: its process exited, or its request thread stopped."""
        if self._failed():
            return
        try:  # the cause Ray knows, when it already knows it (the socket usually closes first)
            fetch.get(self.group.actors[rank].ping.remote(), timeout=1.0)
        except ray.exceptions.RayActorError as dead:
            self._fail(self.rank_error(rank, dead))
            return
        except Exception:
            pass
        node = self.group.node(rank)
        error = EngineUnavailableError(
            f"replica {self.index} rank {rank} (node {node[:12]}) stopped serving: its request socket closed "
            f"({type(exc).__name__}: {exc}; its process exited or its request thread stopped); the replica's "
            "ranks share collectives, so the whole replica was stopped",
            reason="worker_exit", replica=self.index, rank=rank, node=node, detail=str(exc)[:2000])
        error.__cause__ = exc
        self._fail(error)

    def on_lane_broken(self, exc: BaseException) -> None:
        """The compiled graph stopped (a rank died, or it was torn down): fail with the rank's cause."""
        if self._failed():
            return
        self._fail(self.dead_rank_error() or EngineUnavailableError(
            f"replica {self.index}: its compiled request graph failed ({type(exc).__name__}: "
            f"{str(exc).strip()[:300]}); the replica was stopped", reason="exception", replica=self.index,
            detail=str(exc)[:2000]))

    def dead_rank_error(self) -> EngineUnavailableError | None:
        """The error of the first rank that does not answer a ping on its control lane, if any."""
        pings = [actor.ping.remote() for actor in self.group.actors]
        for rank, ping in enumerate(pings):
            try:
                fetch.get(ping, timeout=2.0)
            except ray.exceptions.RayActorError as exc:
                return self.rank_error(rank, exc)
            except Exception:
                continue
        return None

    def rank_error(self, rank: int, exc: BaseException) -> EngineUnavailableError:
        """`rank` died (a RayActorError) or raised `exc`: the replica's error, naming it, its node and the
        cause's type. Every request of the replica gets it, so it never quotes the cause's message (that
        may hold one request's prompt); the engine's log has the whole exception."""
        dead = isinstance(exc, ray.exceptions.RayActorError)
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
        what = "exited" if dead else f"raised {type(cause).__name__} (outside a sequence of its own)"
        node = self.group.node(rank)
        logger.error("replica %d rank %d (node %s) %s", self.index, rank, node[:12], what, exc_info=cause)
        return EngineUnavailableError(
            f"replica {self.index} rank {rank} (node {node[:12]}) {what}; the replica's ranks share "
            "collectives, so the whole replica was stopped", reason="worker_exit" if dead else "exception",
            replica=self.index, rank=rank, node=node, detail=type(cause).__name__)

    def disagreement(self, kinds: dict[int, dict[int, str]]) -> EngineUnavailableError:
        """The ranks named different failed sequences ({rank: {seq_id: exception type}}) for one iteration:
        they ran different work and have diverged."""
        named = "; ".join(f"rank {rank}: {dict(sorted(k.items())) or 'none'}" for rank, k in kinds.items())
        return EngineUnavailableError(
            f"replica {self.index}: its ranks disagree on which sequences failed in one iteration ({named}); "
            "ranks that share collectives ran different work, so the whole replica was stopped",
            reason="exception", replica=self.index, detail=named[:2000])

    def send_error(self, rank: int, exc: BaseException) -> EngineUnavailableError:
        """Sending a request failed at `rank`, after the ranks before it had it."""
        error = EngineUnavailableError(
            f"replica {self.index}: sending a request to rank {rank} failed ({type(exc).__name__}: {exc}) after "
            f"{rank} rank(s) had it; ranks that share collectives cannot run it one-sidedly, so the replica was "
            "stopped", reason="worker_exit", replica=self.index, rank=rank, node=self.group.node(rank))
        error.__cause__ = exc
        return error

    def hang_detail(self, work: Work) -> tuple[int | None, str | None, str]:
        """(first rank that had not replied to `work`, its node, a phrase naming the ranks)."""
        waiting = sorted(work.state.pending) if work.state is not None else []
        first = waiting[0] if waiting else None
        return first, (self.group.node(first) if first is not None else None), f"rank(s) {waiting} had not replied"

    def _liveness_loop(self) -> None:
        """Ping every rank each interval; a failed ping is a dead rank, a ping stuck too long a hung one."""
        outstanding: dict[int, tuple[Future, float]] = {}
        while not self._stop.wait(self.interval_s) and not self._failed():
            for rank, actor in enumerate(self.group.actors):
                error = self._check_ping(rank, actor, outstanding)
                if error is not None:
                    self._fail(error)
                    return

    def _check_ping(self, rank: int, actor: Any, outstanding: dict) -> EngineUnavailableError | None:
        if rank not in outstanding:
            outstanding[rank] = (actor.ping.remote().future(), time.monotonic())
            return None
        ping, sent = outstanding[rank]
        if ping.done():
            del outstanding[rank]
            return self.rank_error(rank, ping.exception()) if ping.exception() is not None else None
        if time.monotonic() - sent > self.hang_s:
            return EngineUnavailableError(
                f"replica {self.index} rank {rank} did not answer a liveness ping for {self.hang_s:.0f}s on its "
                "control lane (the process is stuck outside Python or its node is unreachable)",
                reason="worker_exit", replica=self.index, rank=rank, node=self.group.node(rank))
        return None
