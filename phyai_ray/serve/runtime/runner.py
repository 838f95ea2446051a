"""`GroupRunner`: what one Serve replica of the group deployment does with a request, without Serve.

    runner = GroupRunner(holder, group="abc123", wait_s=630.0, forward=peers_step, forward_stream=peers_stream)
    result = await runner.run(request)     # validate (once), submit to this replica's ONE group, await the result
    async for items in runner.stream(request):   # a streamed request: lists of ("chunk" | "end" | "error", value)

The HTTP route and the handle method `step` both end here. A request is validated once
(`phyai_ray.validation`): the edges pass it `Validated`, a handle caller's raw request is
validated here, and a forwarded request travels validated. A request refused because this group
has failed touched no rank, so it is forwarded (`forward`, a call of another group through the
deployment's handle) instead of failing: between the failure and Serve replacing this replica no
request is lost to it. The forwarded call names the failed groups it passed, so the next group's
router skips them too; after MAX_HOPS failed groups the request fails with the cause. A request
that was already queued or running when the group failed is not retried (the engine never re-runs
a started request); it fails with the cause.

A stream takes the same path: refused at open because this group failed (nothing ran), it is
read from another group through `forward_stream` (the deployment handle's streaming call); it
counts as a session while open; every wait for its next items is bounded by `wait_s`, and the
first item of a forwarded one by FORWARD_WAIT_S. A whole result is awaited `result_wait_s` (default
`wait_s`; unbounded when no request cap is configured: the engine's hang limit and the request's own
limit give it an outcome, so a long job of short iterations is not cut off here).

Failover is at once: a failed group forwards straight away while the registry's view shows a
healthy group it has not passed (the router then picks it). It waits only when no group is healthy
(all failed, or Serve still starting their replacements), never on a route that could only pick a
failed group again: for no longer than the request's deadline, else FORWARD_WAIT_S, then 503 naming
every group and its state.

`view` is the last copy of every group's report (see `registry.py`); it answers `/v1/replicas`,
`/readyz` and the per-group metrics, whichever group the proxy picked. No Ray needed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from phyai_ray.errors import (EngineOverloadedError, EngineUnavailableError, PhyAIError, RequestRejectedError,
                              RequestTimeoutError)
from phyai_ray.async_streams import stream_items
from phyai_ray.executors.futures import awaitable
from phyai_ray.serve.runtime.holder import EngineHolder
from phyai_ray.serve.runtime.registry import GroupReport, describe, note_failed, set_failed, takers
from phyai_ray.validation import Validated, validate

Forward = Callable[[Any, int, tuple], Awaitable[Any]]  # (request, hops, failed groups passed)
StreamForward = Callable[..., AsyncIterator[list]]  # the same (and deadline_s=), for a stream's item lists
MAX_HOPS = 3
FORWARD_WAIT_S = 30.0  # a forwarded request waits this long for a healthy group (Serve replacing them all)
VIEW_POLL_S = 0.05  # while no group is healthy, how often a forwarded request looks at the view again
_ENGINE_ERRORS = (EngineOverloadedError, RequestTimeoutError, EngineUnavailableError, RequestRejectedError)


class SubmitFault(PhyAIError, RuntimeError):
    """`Engine.submit` failed for a reason that is neither the request's nor the engine's state: a bug."""


class GroupRunner:
    """One replica group's request path and its state as the registry sees it."""

    def __init__(self, holder: EngineHolder, *, group: str = "local", wait_s: float = 630.0,
                 forward: Forward | None = None, forward_stream: StreamForward | None = None,
                 result_wait_s: float | None = None) -> None:
        self.holder, self.group, self.wait_s, self.forward = holder, group, wait_s, forward
        self.result_wait_s = wait_s if result_wait_s is None else result_wait_s  # math.inf: unbounded
        self.forward_stream = forward_stream
        self.view: list[GroupReport] = []
        self.routable = True  # False from a Serve replica's start until Serve first checks its health
        self.sessions = 0  # long-lived sessions open on this group: openpi WebSockets, streamed responses
        self.on_timing: Callable[[dict], None] | None = None  # each request's timing (the edge's metrics)
        self.direct: tuple[str, int] | None = None  # (host, port) of its own port under Serve's direct ingress

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

    async def run(self, request: Any, *, hops: int = 0, failed: tuple = (), forward: bool = True,
                  deadline_s: float | None = None, timing: dict | None = None, late: str | None = None) -> Any:
        """The result of `request`, or the engine's error; forwarded when this group has failed.

        `request` is `Validated` (the edges), or is validated here (`RequestRejectedError`).
        `forward=False` keeps the request on this group (a session bound to it): it fails instead.
        `deadline_s` counts from this call (the request's arrival): `Engine.submit`'s deadline, and
        `late` ("finish" / "drop"; None: the deployment's BatchingConfig.late) is `Engine.submit`'s. A
        `timing` dict is filled with the request's `EngineFuture.timing()` and its `weight_version` (the
        version of the weights that computed it, not the replica's current one) when it ran on this group.
        """
        note_failed(tuple(failed))
        received = time.monotonic()
        if not isinstance(request, Validated):  # a handle caller's request; what is forwarded is validated
            request = await asyncio.to_thread(validate, self.entry, request)
        try:
            future = await asyncio.to_thread(self._submit, request, deadline_s, received, late)
        except EngineUnavailableError:
            if not forward or hops >= MAX_HOPS or self.forward is None or self.engine.healthy:
                raise
            left = None if deadline_s is None else max(deadline_s - (time.monotonic() - received), 1e-6)
            return await self._forwarded(request, hops + 1, (*failed, self.group), left, late)
        try:
            return await self._within(awaitable(future), "; the request keeps running on its group",
                                      self.result_wait_s)
        finally:
            if future.done() and callable(getattr(future, "timing", None)):  # an EngineFuture
                # the version stamped when the request reached the ranks: the weights that computed it
                measured = {**future.timing(), "weight_version": getattr(future, "weight_version", None)}
                if timing is not None:
                    timing.update(measured)
                if self.on_timing is not None:
                    self.on_timing(measured)

    async def stream(self, request: Any, *, hops: int = 0, failed: tuple = (), forward: bool = True,
                     deadline_s: float | None = None) -> AsyncIterator[list[tuple[str, Any]]]:
        """The items of `request`'s stream, in lists of those ready together; leaving early cancels it.
        Validated as `run` validates; refused at open because this group failed, it is forwarded (see the module).
        `deadline_s` (from this call): its first chunk's deadline (`stream_items`)."""
        received = time.monotonic()
        note_failed(tuple(failed))
        if not isinstance(request, Validated):
            request = await asyncio.to_thread(validate, self.entry, request)
        with self.session():  # the stream counts as open on this group until its last item
            left = None if deadline_s is None else max(deadline_s - (time.monotonic() - received), 1e-6)
            items = stream_items(self.engine, request, deadline_s=left)
            try:
                try:
                    first = await _next_items(items, self.wait_s, "for the stream's first chunk")
                except EngineUnavailableError:  # refused at open: nothing ran
                    if not forward or hops >= MAX_HOPS or self.forward_stream is None or self.engine.healthy:
                        raise
                    left = None if deadline_s is None else max(deadline_s - (time.monotonic() - received), 1e-6)
                    async for got in self._forwarded_stream(request, hops + 1, (*failed, self.group), left):
                        yield got
                    return
                except StopAsyncIteration:
                    return
                yield first
                while True:
                    try:
                        got = await _next_items(items, self.wait_s, "for the stream's next chunk")
                    except StopAsyncIteration:
                        return
                    yield got
            finally:
                await items.aclose()

    async def _forwarded_stream(self, request: Any, hops: int, failed: tuple,
                                deadline_s: float | None = None) -> AsyncIterator[list]:
        """Another group's stream; what is left of its first chunk's deadline travels with it and bounds
        the wait for a group to take it."""
        set_failed(self.group, True)  # before routing: this process's router must not pick this group
        limit = min(self.wait_s, FORWARD_WAIT_S, deadline_s if deadline_s is not None else float("inf"))
        began = time.monotonic()
        await self._until_a_group_can_take("stream", failed, limit)
        extra = {} if deadline_s is None else {"deadline_s": _left(began, deadline_s)}
        remote = self.forward_stream(request, hops, failed, **extra)
        try:
            with self._as_forwarded("stream", limit):
                got = await _next_items(remote, _left(began, limit), "from the group it was forwarded to")
            while True:
                yield got
                with _unwrapped():
                    got = await _next_items(remote, self.wait_s, "from the group it was forwarded to")
        except StopAsyncIteration:
            return
        finally:
            cancel = getattr(remote, "cancel", None)
            if cancel is not None:
                cancel()

    async def _forwarded(self, request: Any, hops: int, failed: tuple, deadline_s: float | None = None,
                         late: str | None = None) -> Any:
        """Another group's result; its error as raised there (not wrapped in Ray's task error). The
        request's deadline (what is left of it) and `late` travel with it, and bound the wait."""
        set_failed(self.group, True)  # before routing: this process's router must not pick this group
        limit = min(self.wait_s, FORWARD_WAIT_S, deadline_s if deadline_s is not None else float("inf"))
        began = time.monotonic()
        await self._until_a_group_can_take("request", failed, limit)
        if deadline_s is not None:
            deadline_s = _left(began, deadline_s)
        extra = {k: v for k, v in (("deadline_s", deadline_s), ("late", late)) if v is not None}
        with self._as_forwarded("request", limit):
            return await self._within(self.forward(request, hops, failed, **extra),
                                      "from the group it was forwarded to", _left(began, limit))

    async def _until_a_group_can_take(self, what: str, failed: tuple, limit: float) -> None:
        """Return at once while the view shows a healthy group past `failed` (or no view yet: the router
        decides); else look again every VIEW_POLL_S for `limit` seconds, then 503 naming every group."""
        end = time.monotonic() + limit
        while takers(self.view, failed) == []:
            left = end - time.monotonic()
            if left <= 0:
                raise self._none_healthy(what, limit)
            await asyncio.sleep(min(VIEW_POLL_S, left))

    def _none_healthy(self, what: str, limit: float) -> EngineUnavailableError:
        others = describe([r for r in self.view if r.group != self.group])
        return EngineUnavailableError(f"group {self.group} has failed and no healthy group took the {what} within "
                                      f"{limit:.0f}s (the other groups: {others}); retry later",
                                      reason="no_healthy_replica")

    @contextlib.contextmanager
    def _as_forwarded(self, what: str, limit: float) -> Iterator[None]:
        """A forwarded call's errors as the other group raised them; no answer within `limit` means that
        no healthy group took it."""
        try:
            with _unwrapped():
                yield
        except RequestTimeoutError:
            raise self._none_healthy(what, limit) from None

    def _submit(self, request: Validated, deadline_s: float | None = None, received: float | None = None,
                late: str | None = None) -> Any:
        if deadline_s is not None and received is not None:  # what is left of it (the engine answers a spent one)
            deadline_s = max(deadline_s - (time.monotonic() - received), 1e-6)
        try:
            if deadline_s is None and late is None:  # anything with Engine.submit(request) serves here
                return self.engine.submit(request)
            if late is None:
                return self.engine.submit(request, deadline_s=deadline_s)
            return self.engine.submit(request, deadline_s=deadline_s, late=late)
        except _ENGINE_ERRORS:
            raise
        except Exception as exc:
            text = " ".join(str(exc).split())
            raise SubmitFault(f"submitting the request failed: {type(exc).__name__}: {text}") from exc

    async def _within(self, awaitable: Awaitable[Any], where: str, timeout_s: float | None = None) -> Any:
        """Await without ever cancelling it (asyncio.wait does not cancel); RequestTimeoutError after wait_s."""
        limit = self.wait_s if timeout_s is None else timeout_s
        task = asyncio.ensure_future(_awaited(awaitable))
        done, _ = await asyncio.wait({task}, timeout=None if limit == math.inf else limit)
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
            replica_pid=os.getpid(), rebuilds=self.holder.rebuilds, requests=requests,
            direct_host=self.direct[0] if self.direct else None, direct_port=self.direct[1] if self.direct else None)

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


def _left(began: float, limit: float) -> float:
    """What is left of `limit` seconds counted from `began` (never quite 0: a spent one still answers)."""
    return max(limit - (time.monotonic() - began), 1e-6)


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """Raise another group's error as it was raised there (ray.exceptions.RayTaskError carries it)."""
    try:
        yield
    except Exception as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception) and not isinstance(exc, (StopAsyncIteration, RequestTimeoutError)):
            raise cause from None
        raise


async def _next_items(items: AsyncIterator[Any], limit_s: float, where: str) -> Any:
    """The next item of `items` within `limit_s` (StopAsyncIteration at its end); past it the pending
    read is cancelled (the stream closes) and RequestTimeoutError says where it waited."""
    task = asyncio.ensure_future(items.__anext__())
    try:
        done, _ = await asyncio.wait({task}, timeout=limit_s)
    except BaseException:  # the reader left (cancelled): the read ends before `items` can be closed
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        raise RequestTimeoutError(f"no stream item within {limit_s:.0f}s {where}", waited_s=limit_s)
    return task.result()
