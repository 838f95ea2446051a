"""`GroupRunner`: what one Serve replica of the group deployment does with a request, without Serve.

    runner = GroupRunner(holder, group="abc123", wait_s=630.0, forward=peers_step)
    result = await runner.run(request)     # validate, submit to this replica's ONE group, await the result

The HTTP route and the handle method `step` both end here. A request refused because this group
has failed touched no rank, so it is forwarded (`forward`, a call of another group through the
deployment's handle) instead of failing: between the failure and Serve replacing this replica no
request is lost to it. The forwarded call names the failed groups it passed, so the next group's
router skips them too; after MAX_HOPS failed groups the request fails with the cause. A request that was already queued or running when the group failed is
not retried (the engine never re-runs a started request); it fails with the cause.

`view` is the last copy of every group's report (see `registry.py`); it answers `/v1/replicas`,
`/readyz` and the per-group metrics, whichever group the proxy picked. No Ray needed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any, Awaitable, Callable, Iterator

from phyai_ray.errors import (EngineOverloadedError, EngineUnavailableError, PhyAIError,
                              RequestTimeoutError)
from phyai_ray.serve.holder import EngineHolder
from phyai_ray.serve.registry import GroupReport, note_failed, set_failed

Forward = Callable[[Any, int, tuple], Awaitable[Any]]  # (request, hops, failed groups passed)
MAX_HOPS = 3
FORWARD_WAIT_S = 30.0  # a forwarded request waits this long for a healthy group (Serve replacing them all)
_ENGINE_ERRORS = (EngineOverloadedError, RequestTimeoutError, EngineUnavailableError)


class SubmitFault(PhyAIError, RuntimeError):
    """`Engine.submit` failed for a reason that is neither the request's nor the engine's state: a bug."""


class GroupRunner:
    """One replica group's request path and its state as the registry sees it."""

    def __init__(self, holder: EngineHolder, *, group: str = "local", wait_s: float = 630.0,
                 forward: Forward | None = None) -> None:
        self.holder, self.group, self.wait_s, self.forward = holder, group, wait_s, forward
        self.view: list[GroupReport] = []
        self.routable = True  # False from a Serve replica's start until Serve first checks its health
        self.sessions = 0  # long-lived sessions open on this group: openpi WebSockets, streamed responses

    @property
    def engine(self) -> Any:
        return self.holder.engine

    @property
    def entry(self) -> Any:
        return self.holder.engine.entry

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Count a long-lived session (a WebSocket, a streamed response) as open on this group while inside."""
        self.sessions += 1
        try:
            yield
        finally:
            self.sessions -= 1

    async def run(self, request: Any, *, hops: int = 0, failed: tuple = (), validate: bool = True,
                  forward: bool = True) -> Any:
        """The result of `request`, or the engine's error; forwarded when this group has failed.

        `forward=False` keeps the request on this group (a session bound to it): it fails instead.
        """
        note_failed(tuple(failed))
        try:
            future = await asyncio.to_thread(self._submit, request, validate)
        except EngineUnavailableError:
            if not forward or hops >= MAX_HOPS or self.forward is None or self.engine.healthy:
                raise
            return await self._forwarded(request, hops + 1, (*failed, self.group))
        return await self._within(asyncio.wrap_future(future), "; the request keeps running on its group")

    async def _forwarded(self, request: Any, hops: int, failed: tuple) -> Any:
        """Another group's result; its error as raised there (not wrapped in Ray's task error)."""
        set_failed(self.group, True)  # before routing: this process's router must not pick this group
        try:
            return await self._within(self.forward(request, hops, failed), "from the group it was forwarded to",
                                      min(self.wait_s, FORWARD_WAIT_S))
        except RequestTimeoutError:
            raise EngineUnavailableError(f"group {self.group} has failed and no healthy group took the request "
                                         f"within {FORWARD_WAIT_S:.0f}s; retry later", reason="no_healthy_replica")
        except Exception as exc:
            cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError carries the original
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def _submit(self, request: Any, validate: bool) -> Any:
        if validate:
            self.entry.validate_request(request)  # its error is the caller's to see, as it is
        try:
            return self.engine.submit(request)
        except _ENGINE_ERRORS:
            raise
        except Exception as exc:
            text = " ".join(str(exc).split())
            raise SubmitFault(f"submitting the request failed: {type(exc).__name__}: {text}") from exc

    async def _within(self, awaitable: Awaitable[Any], where: str, timeout_s: float | None = None) -> Any:
        """Await without ever cancelling it (asyncio.wait does not cancel); RequestTimeoutError after wait_s."""
        limit = self.wait_s if timeout_s is None else timeout_s
        task = asyncio.ensure_future(_awaited(awaitable))
        done, _ = await asyncio.wait({task}, timeout=limit)
        if not done:
            raise RequestTimeoutError(f"no result within {limit:.0f}s {where}".replace(" ;", ";"), waited_s=limit)
        return task.result()

    # -- state ---------------------------------------------------------------------------------
    def report(self, requests: tuple[tuple[str, str, int], ...] = ()) -> GroupReport:
        """This group's report for the registry (one engine, one replica group)."""
        status = self.engine.replica_status()[0]
        return GroupReport(
            group=self.group, state=("serving" if self.routable else "starting") if status.healthy else "failed",
            world_size=status.world_size,
            in_flight=status.in_flight, sessions=self.sessions, queued=status.queued, dispatched=status.dispatched, served=status.served,
            errored=status.errored, failure=status.failure, failure_reason=status.failure_reason,
            failed_rank=status.failed_rank, nodes=tuple(status.nodes), pids=tuple(status.pids),
            replica_pid=os.getpid(), rebuilds=self.holder.rebuilds, requests=requests)

    def groups(self, requests: tuple[tuple[str, str, int], ...] = ()) -> list[GroupReport]:
        """Every group: the registry's copy, with this group's own state fresh."""
        mine = self.report(requests)
        others = [r for r in self.view if r.group != self.group]
        return sorted([mine, *others], key=lambda r: (r.state == "gone", r.group))

    @property
    def ready(self) -> bool:
        """Whether some group of the app can serve (this one, or another by the last report)."""
        mine = self.engine.healthy and self.routable
        return mine or any(r.healthy for r in self.view if r.group != self.group)


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
