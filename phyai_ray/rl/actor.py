"""`EngineActor`: a Ray actor that owns an `Engine`, for trainers that hold rollout replicas as handles.

    from phyai_ray import EngineActor
    rollout = EngineActor.options(num_cpus=0).remote(args, DeploymentConfig(replica_count=2))
    out = await rollout.step.remote(request)              # or ray.get(...); from any actor or task
    for ref in rollout.stream.remote(request): chunk = await ref        # token plugins: partial outputs
    info = await rollout.submit.remote(request, session="episode-7")   # StepResult(value, replica, weight_version)
    info = await rollout.submit.remote(frame, deadline_s=0.1)   # its own deadline, from its arrival; info.timing
    ray.get(rollout.pause.remote(mode="wait"))            # control calls: their own concurrency group

Data methods (`step`, `submit`) run on the actor's event loop and await the engine's futures, so
thousands can be in flight. Control methods (pause / resume / sleep / wake_up / reset_cache, the
four weight-sync phases, replica_status, collective_rpc) run in the "control" concurrency group,
each on a thread, so a weight sync is never stuck behind generate calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray

from phyai_ray.executors.futures import awaitable

CONTROL = {"concurrency_group": "control"}


@dataclass(frozen=True)
class StepResult:
    """A result with where it came from: the replica and the weight version that produced it, and its
    timing (`EngineFuture.timing()`: queue_ms, infer_ms, batch_size, deadline_ms, deadline_met)."""

    value: Any
    replica: int | None
    weight_version: Any
    timing: dict | None = None


class _EngineActor:
    def __init__(self, args: Any, deployment: Any = None) -> None:
        from phyai_ray.engine import Engine

        self.engine = Engine(args, deployment)

    async def step(self, request: Any, session: Any = None, deadline_s: float | None = None,
                   late: str | None = None) -> Any:
        return (await self.submit(request, session, deadline_s, late)).value

    async def submit(self, request: Any, session: Any = None, deadline_s: float | None = None,
                     late: str | None = None) -> StepResult:
        """`deadline_s` counts from when the call reached the actor (`Engine.submit`'s deadline);
        `late` ("finish" / "drop", None: BatchingConfig.late) as for `Engine.submit`."""
        future = self.engine.submit(request, session, deadline_s=deadline_s, late=late)
        value = await awaitable(future)
        return StepResult(value, future.replica, future.weight_version, future.timing())

    async def stream(self, request: Any, session: Any = None, max_buffered: int = 64) -> Any:
        """Async generator of the output rank's chunks (`engine.stream`); `ray.cancel` it to stop early:
        every rank stops at the same step (a sequence batched per iteration leaves at the next one).
        Read without a thread per chunk (`phyai_ray.async_streams.stream_items`): a pump thread for plugins that
        stream whole requests, none for iterative ones; cancelling never races a pull in progress."""
        from phyai_ray.async_streams import stream_items

        items = stream_items(self.engine, request, session=session, max_buffered=max_buffered)
        try:
            async for ready in items:
                for kind, value in ready:
                    if kind == "error":
                        raise value
                    if kind == "end":
                        return
                    yield value
        finally:
            await items.aclose()

    @ray.method(**CONTROL)
    async def pause(self, mode: str = "wait", replicas: Any = None, timeout: float | None = None) -> list:
        return await asyncio.to_thread(self.engine.pause, mode, replicas, timeout)

    @ray.method(**CONTROL)
    async def resume(self, replicas: Any = None, timeout: float | None = None) -> list:
        return await asyncio.to_thread(self.engine.resume, replicas, timeout)

    @ray.method(**CONTROL)
    async def sleep(self, level: int = 1, replicas: Any = None, timeout: float | None = None) -> list:
        return await asyncio.to_thread(self.engine.sleep, level, replicas, timeout)

    @ray.method(**CONTROL)
    async def wake_up(self, tags: Any = None, replicas: Any = None, timeout: float | None = None) -> list:
        return await asyncio.to_thread(self.engine.wake_up, tags, replicas, timeout)

    @ray.method(**CONTROL)
    async def reset_cache(self, replicas: Any = None, timeout: float | None = None) -> list:
        return await asyncio.to_thread(self.engine.reset_cache, replicas, timeout)

    @ray.method(**CONTROL)
    async def init_weight_transfer(self, backend: str = "object_store", **kwargs: Any) -> list:
        return await asyncio.to_thread(lambda: self.engine.init_weight_transfer(backend, **kwargs))

    @ray.method(**CONTROL)
    async def start_weight_update(self, version: Any, replicas: Any = None, timeout: float | None = None,
                                  lease_s: float | None = None) -> list:
        return await asyncio.to_thread(self.engine.start_weight_update, version, replicas, timeout, lease_s)

    @ray.method(**CONTROL)
    async def update_weights(self, buckets: Any, replicas: Any = None, timeout: float | None = None) -> list:
        return await asyncio.to_thread(self.engine.update_weights, buckets, replicas, timeout)

    @ray.method(**CONTROL)
    async def finish_weight_update(self, replicas: Any = None, timeout: float | None = None) -> list:
        return await asyncio.to_thread(self.engine.finish_weight_update, replicas, timeout)

    @ray.method(**CONTROL)
    async def replica_status(self) -> list:
        return self.engine.replica_status()

    @ray.method(**CONTROL)
    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(lambda: self.engine.collective_rpc(method, *args, **kwargs))

    @ray.method(**CONTROL)
    async def close(self) -> None:
        await asyncio.to_thread(self.engine.close)


# Every data call just awaits an engine future, so the default group admits as many as the engine
# queues can hold; the engine itself sheds past max_queued_requests (EngineOverloadedError). A low
# limit here would make Ray queue calls in front of the actor, where a control call arriving later
# would wait behind them.
MAX_DATA_CALLS = 1 << 16
EngineActor = ray.remote(concurrency_groups={"control": 8}, max_concurrency=MAX_DATA_CALLS)(_EngineActor)
EngineActor.__doc__ = __doc__
