"""`ReplicaHealth`: how a Ray replica learns that a rank died or hangs, and the error that names it.

    a lane broke (socket closed, compiled graph failed) -> the rank Ray knows dead, or the lane's cause
    liveness loop: a ping per rank on its control lane every liveness_interval_s; no answer for
                   max(10 s, 40 intervals) means stuck outside Python or unreachable
    _rank_error / _send_error: an EngineUnavailableError naming the replica, rank, node and cause

A part of `RayTransport` (actors/replica.py): it reads the transport's actors, infos and config, and
fails the replica through the transport's link.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import ray

from actors import fetch
from phyai_ray.errors import EngineUnavailableError
from phyai_ray.work import Work


class ReplicaHealth:
    """Dead and stuck ranks of a `RayTransport`, and the errors that name them."""

    def _on_socket_broken(self, rank: int, exc: BaseException) -> None:
        """A rank's socket closed or carried garbage: its process exited, or its request thread stopped."""
        if self._failure is not None:
            return
        try:  # the cause Ray knows, when it already knows it (the socket usually closes first)
            fetch.get(self._actors[rank].ping.remote(), timeout=1.0)
        except ray.exceptions.RayActorError as dead:
            self._fail(self._rank_error(rank, dead))
            return
        except Exception:
            pass
        error = EngineUnavailableError(
            f"replica {self.index} rank {rank} (node {self._node(rank)[:12]}) stopped serving: its request socket "
            f"closed ({type(exc).__name__}: {exc}; its process exited or its request thread stopped); the replica's ranks share collectives, so the whole replica was stopped",
            reason="worker_exit", replica=self.index, rank=rank, node=self._node(rank), detail=str(exc)[:2000])
        error.__cause__ = exc
        self._fail(error)

    def _on_lane_broken(self, exc: BaseException) -> None:
        """The compiled graph stopped (a rank died, or it was torn down): fail with the rank's cause."""
        if self._failure is not None:
            return
        self._fail(self._dead_rank_error() or EngineUnavailableError(
            f"replica {self.index}: its compiled request graph failed ({type(exc).__name__}: "
            f"{str(exc).strip()[:300]}); the replica was stopped", reason="exception", replica=self.index,
            detail=str(exc)[:2000]))

    def _dead_rank_error(self) -> EngineUnavailableError | None:
        """The error of the first rank that does not answer a ping on its control lane, if any."""
        pings = [actor.ping.remote() for actor in self._actors]
        for rank, ping in enumerate(pings):
            try:
                fetch.get(ping, timeout=2.0)
            except ray.exceptions.RayActorError as exc:
                return self._rank_error(rank, exc)
            except Exception:
                continue
        return None

    def _rank_error(self, rank: int, exc: BaseException) -> EngineUnavailableError:
        dead = isinstance(exc, ray.exceptions.RayActorError)
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
        what = "exited" if dead else f"raised {type(cause).__name__}: {str(cause).strip().splitlines()[-1:]}"
        error = EngineUnavailableError(
            f"replica {self.index} rank {rank} (node {self._node(rank)[:12]}) {what}; the replica's ranks share "
            "collectives, so the whole replica was stopped", reason="worker_exit" if dead else "exception",
            replica=self.index, rank=rank, node=self._node(rank), detail=str(cause)[:2000])
        error.__cause__ = cause
        return error

    def _send_error(self, rank: int, exc: BaseException) -> EngineUnavailableError:
        error = EngineUnavailableError(
            f"replica {self.index}: sending a request to rank {rank} failed ({type(exc).__name__}: {exc}) after "
            f"{rank} rank(s) had it; ranks that share collectives cannot run it one-sidedly, so the replica was "
            "stopped", reason="worker_exit", replica=self.index, rank=rank, node=self._node(rank))
        error.__cause__ = exc
        return error

    def hang_detail(self, work: Work) -> tuple[int | None, str | None, str]:
        waiting = sorted(work.state.pending) if work.state is not None else []
        first = waiting[0] if waiting else None
        return first, (self._node(first) if first is not None else None), f"rank(s) {waiting} had not replied"

    def _liveness_loop(self) -> None:
        """Ping every rank each interval; a failed ping is a dead rank, a ping stuck too long a hung one."""
        interval = self._proc.liveness_interval_s
        hang_s = max(10.0, 40 * interval)
        outstanding: dict[int, tuple[Future, float]] = {}
        while not self._stop.wait(interval) and self._failure is None:
            for rank, actor in enumerate(self._actors):
                error = self._check_ping(rank, actor, outstanding, hang_s)
                if error is not None:
                    self._fail(error)
                    return

    def _check_ping(self, rank: int, actor: Any, outstanding: dict, hang_s: float) -> EngineUnavailableError | None:
        if rank not in outstanding:
            outstanding[rank] = (actor.ping.remote().future(), time.monotonic())
            return None
        ping, sent = outstanding[rank]
        if ping.done():
            del outstanding[rank]
            return self._rank_error(rank, ping.exception()) if ping.exception() is not None else None
        if time.monotonic() - sent > hang_s:
            return EngineUnavailableError(
                f"replica {self.index} rank {rank} did not answer a liveness ping for {hang_s:.0f}s on its control "
                "lane (the process is stuck outside Python or its node is unreachable)",
                reason="worker_exit", replica=self.index, rank=rank, node=self._node(rank))
        return None
