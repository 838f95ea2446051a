"""`get`: `ray.get` of object refs with a deadline, without the blocking call Ray warns about.

An `EngineActor` is an asyncio actor, and Ray logs "Using blocking ray.get inside async actor" for every
`ray.get` in its process, whatever the thread (the engine's own reply, health and startup threads
included). The engine's threads wait on a rank's reply through `ObjectRef.future()` instead: the same
values, the same errors (a task's `RayTaskError`, a dead actor's `ActorDiedError`), the same deadline
(`GetTimeoutError`, a `TimeoutError`), and nothing for Ray to warn about. Only the engine's side uses
it; a rank's own process is not an asyncio actor.

    replies = get([actor.ping.remote() for actor in actors], timeout=2.0)
"""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Sequence

import ray


def get(refs: Any, timeout: float) -> Any:
    """The value of `refs` (one ObjectRef) or their values (a sequence), in order, within `timeout` seconds
    for all of them; raises `ray.exceptions.GetTimeoutError` past it, or the first ref's error."""
    one = isinstance(refs, ray.ObjectRef)
    pending: Sequence[Any] = [refs] if one else list(refs)
    futures = [ref.future() for ref in pending]
    end = time.monotonic() + timeout
    values = []
    for k, future in enumerate(futures):
        try:
            values.append(future.result(timeout=max(0.0, end - time.monotonic())))
        except FutureTimeout:
            for rest in futures[k:]:
                rest.cancel()  # the reply is no longer awaited; Ray keeps the object until its refs go
            raise ray.exceptions.GetTimeoutError(
                f"{len(futures) - k} of {len(futures)} object(s) were not ready within {timeout:.1f}s") from None
    return values[0] if one else values
