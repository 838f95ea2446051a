"""A replica's request queue: where its requests wait and how they are batched.

One per replica, chosen once when the replica is built (`ScheduledReplica.enable_iterations`):

    StepQueue      requests as steps, or batches of steps, of the scheduler's own queue (scheduler.py)
    IterationLoop  requests as sequences of the continuous-batching loop (iterations.py)

Both answer the same calls (`RequestQueue`), so nothing else asks which one a replica has. Beneath
both, the scheduler is the rank pipeline: in-order dispatch, the hang clock, collective_rpc
ordering, holding for control calls. Both settle through the same ledger (ledger.py).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from phyai_ray.executors.ledger import Counts
from phyai_ray.work import STEP, STREAM

_NONE = Counts(0, 0, 0, 0)


class RequestQueue(Protocol):
    """Where one replica's requests wait until they reach its ranks."""

    iterative: bool

    def submit(self, request: Any, *, key: Any = None, size: int = 1, deadline: float | None = None,
               late: str = "finish") -> Any: ...

    def submit_stream(self, request: Any, max_buffered: int, deadline: float | None = None) -> tuple[Any, Any]:
        """`deadline`: the first chunk's (monotonic); the iteration loop admits and drops by it, a
        StepQueue leaves it to the stream's reader (Engine.read_stream, async_streams.stream_items)."""

    def counts(self) -> Counts:
        """Requests it holds beyond the scheduler's own (a StepQueue's are the scheduler's)."""

    def has_room(self) -> bool: ...

    def snapshot(self) -> dict[str, Any]: ...

    def quiesce(self, op: str, mode: str, deadline: float) -> int:
        """Stop as control call `op` needs; how many requests pause(mode="abort") ended."""

    def release(self, version: Any) -> None: ...

    def stop(self, refusal: Callable[[], BaseException], *, cancel_waiting: bool = False) -> None: ...


class StepQueue:
    """Requests of a plugin without the iteration protocol: each one a step (or a batch member) of the
    scheduler. `ranks` serializes a request once, here, before it takes a slot."""

    iterative = False

    def __init__(self, scheduler: Any, ranks: Any, limit_s: float) -> None:
        self._scheduler, self._ranks, self._limit_s = scheduler, ranks, limit_s

    def submit(self, request: Any, *, key: Any = None, size: int = 1, deadline: float | None = None,
               late: str = "finish") -> Any:
        payload = self._ranks.prepare(request)
        return self._scheduler.submit(STEP, payload, self._limit_s, key=key, size=size,
                                      weight=self._ranks.weight(payload), deadline=deadline, late=late)

    def submit_stream(self, request: Any, max_buffered: int, deadline: float | None = None) -> tuple[Any, Any]:
        payload, reader_for = self._ranks.stream(request, max_buffered)
        future = self._scheduler.submit(STREAM, payload, self._limit_s)
        return future, reader_for(future)

    def counts(self) -> Counts:
        return _NONE  # its requests are the scheduler's own, counted there

    def has_room(self) -> bool:
        return self._scheduler.has_room()

    def snapshot(self) -> dict[str, Any]:
        return {}

    def quiesce(self, op: str, mode: str, deadline: float) -> int:
        return 0  # the scheduler's hold and drain are all a step queue needs

    def release(self, version: Any) -> None:
        pass

    def stop(self, refusal: Callable[[], BaseException], *, cancel_waiting: bool = False) -> None:
        pass  # what it queued is the scheduler's, stopped there
