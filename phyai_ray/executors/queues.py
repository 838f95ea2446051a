"""A replica's request frontend: where its requests wait and how they are batched.

One per replica, chosen once when the executor is built (`ReplicaExecutor.enable_iterations`):

    StepQueue      requests as steps, or batches of steps, of the scheduler's own queue (scheduler.py)
    IterationLoop  requests as sequences of the continuous-batching loop (iterations.py)

Both answer the same calls, so nothing else asks which one a replica has:

    submit(request, key=, size=, due=) -> future         submit_stream(request, max_buffered) -> (future, reader)
    counts()        requests it holds beyond the scheduler's own (a StepQueue's are the scheduler's)
    has_room()      snapshot()      iterative
    quiesce(op, mode, deadline) -> aborted          release(weight_version)          stop(refusal, cancel_waiting=)

Beneath both, the scheduler is the rank pipeline: in-order dispatch, the hang clock, collective_rpc
ordering, holding for control calls. Both settle through the same ledger (ledger.py).
"""

from __future__ import annotations

from typing import Any, Callable

from phyai_ray.executors.ledger import Counts
from phyai_ray.work import Kind

_NONE = Counts(0, 0, 0, 0)


class StepQueue:
    """Requests of a plugin without the iteration protocol: each one a step (or a batch member) of the scheduler."""

    iterative = False

    def __init__(self, executor: Any) -> None:
        self._executor = executor

    def submit(self, request: Any, *, key: Any = None, size: int = 1, due: float | None = None) -> Any:
        executor = self._executor
        payload = executor._prepare(request)  # serialized once, here, before it takes a slot
        return executor.scheduler.submit(Kind.STEP, payload, executor._step_limit_s, key=key, size=size,
                                         weight=executor._weight(payload), due=due)

    def submit_stream(self, request: Any, max_buffered: int) -> tuple[Any, Any]:
        return self._executor._submit_stream(request, max_buffered)

    def counts(self) -> Counts:
        return _NONE  # its requests are the scheduler's own, counted there

    def has_room(self) -> bool:
        return self._executor.scheduler.has_room()

    def snapshot(self) -> dict[str, Any]:
        return {}

    def quiesce(self, op: str, mode: str, deadline: float) -> int:
        return 0  # the scheduler's hold and drain are all a step queue needs

    def release(self, version: Any) -> None:
        pass

    def stop(self, refusal: Callable[[], BaseException], *, cancel_waiting: bool = False) -> None:
        pass  # what it queued is the scheduler's, stopped there
