"""The inline executor: the plugin runs in the caller's process, on one thread, with no Ray.

The same replica as a Ray replica group (queue, `max_queued_requests`, two clocks, exact
accounting: base.py), dispatching ONE request at a time to the plugin's thread: a hand-off in one
process costs microseconds, so nothing is gained by pipelining, and every request still waiting
can be cancelled. A plugin exception fails only its request. A request past its deadline fails with
`RequestTimeoutError` and the replica keeps serving; only a call RUNNING longer than its limit
fails the replica (a stuck plugin cannot be interrupted), and every later request then raises
`EngineUnavailableError`.

    replica = ScheduledReplica(InlineExecutor(build_runner, startup_timeout_s=60), max_ongoing=1, ...)
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any, Callable

from phyai_ray.executors.replica import ReplicaLink, rank_args
from phyai_ray.executors.serial import SerialWorker
from phyai_ray.streams import ChunkSink, LocalReader
from phyai_ray.work import BATCH, CALL, STEP, STREAM, Work
from phyai_ray.rank import heap
from phyai_ray.rank.runner import RankRunner

logger = logging.getLogger(__name__)


class InlineExecutor:
    """One rank in the caller's process, run on a `SerialWorker` thread (or the caller's own)."""

    name = "inline"
    runs_here = True  # the caller's thread may run a request (nothing queued or running)
    lockstep = False
    skips_expired = True  # one rank: a request whose deadline passed before it started is skipped
    worker_idle_exit_s: float | None = 0.5  # see SerialWorker: no second OpenMP pool left behind
    world_size = 1
    max_batch_weight = None

    def __init__(self, build_runner: Callable[[], RankRunner], *, startup_timeout_s: float,
                 shutdown_timeout_s: float = 10.0, thread_name: str = "phyai-inline-0") -> None:
        self._shutdown_s, self._closed = shutdown_timeout_s, False
        self._link: ReplicaLink | None = None
        self._worker = SerialWorker(name=thread_name, idle_exit_s=self.worker_idle_exit_s)
        started = self._worker.call(build_runner)
        try:
            self._runner: RankRunner = started.result(timeout=startup_timeout_s)
        except TimeoutError:
            self._worker.stop()
            raise TimeoutError(f"{self.name} plugin creation took longer than startup_timeout_s="
                               f"{startup_timeout_s}; raise WorkerSupervisorConfig.startup_timeout_s") from None
        except BaseException:
            self._worker.stop()
            raise
        self.entry = self._runner.entry
        self.batchable, self.iterative = self._runner.batchable, self._runner.iterative
        self._device_guard = _device_guard(self._runner)
        if self.worker_idle_exit_s is not None:
            self._worker.retire()  # the plugin was built; the first step may run on the caller's thread

    def bind(self, link: ReplicaLink) -> None:
        self._link = link

    def prepare(self, payload: Any) -> Any:
        return payload  # one process: nothing to serialize

    def weight(self, prepared: Any) -> int:
        return 0

    def launch(self, work: Work) -> None:
        self._worker.put(lambda: self._guarded(self._run, work))

    def run_here(self, work: Work) -> None:
        """On the caller's thread (nothing else at the rank): the hang clock still watches it, and other
        callers queue behind it; this thread is in the plugin and returns when it does. It was
        dispatched just now, so it cannot have expired: it runs at once. A request run here was
        dispatched with batching off (the request queue sets `here` only then): it is a plain step."""
        if self._device_guard is None:
            self._run_now(work, True)
        else:
            with self._device_guard():
                self._run_now(work, True)

    def step_here(self, request: Any) -> Any:
        """One plain step on the caller's thread (`RankPipeline.run_here`): nothing else is at the rank."""
        if self._link.failure() is not None:
            raise self._link.unavailable_error()
        if self._device_guard is None:
            return self._runner.step(request)
        with self._device_guard():
            return self._runner.step(request)

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` with the rank's CUDA device current (a fresh worker thread starts on device 0)."""
        if self._device_guard is None:
            return fn(*args)
        with self._device_guard():
            return fn(*args)

    def _run(self, work: Work) -> None:
        """Run `work` unless its deadline already failed it (one rank: safe to skip)."""
        if self.skips_expired and not work.unfinished:
            self._link.finished(work)
            return
        self._run_now(work)

    def _run_now(self, work: Work, here: bool = False) -> None:
        link = self._link
        if link.failure() is not None:
            link.complete(work, error=link.unavailable_error())
            return
        try:
            value = self._runner.step(work.payload) if here and work.kind == STEP else self._execute(work)
        except BaseException as exc:  # the plugin's own exception goes to the caller as is
            link.complete(work, error=exc)
        else:
            link.complete(work, value)

    def stream(self, request: Any, max_buffered: int) -> tuple[Any, Callable[[Any], Any]]:
        sink = ChunkSink(max_buffered)
        return (request, sink), lambda future: LocalReader(sink, future)

    def _execute(self, work: Work) -> Any:
        if work.kind == STEP and self._link.batching():  # a batch of one: an exception item fails it
            return _only(self._runner.execute(BATCH, [work.payload]))
        if work.kind == STREAM:
            request, sink = work.payload
            return self._runner.execute(STREAM, request, sink)
        value = self._runner.execute(work.kind, work.payload)
        return [value] if work.kind == CALL and work.all_ranks else value

    def control(self, op: str, args: tuple, timeout_s: float) -> Future:
        """On the plugin's thread (idle: control calls drain first, except pause(mode="keep"))."""
        args = rank_args(op, args, 0, self.world_size)
        return self._worker.call(lambda: [self._guarded(self._runner.control, op, args)])

    def hang_detail(self, work: Work) -> tuple[int | None, str | None, str]:
        return 0, None, "rank(s) [0] had not replied"

    def abandon(self) -> None:
        self._worker.stop()

    def close(self, drain: bool) -> None:
        """Stop the plugin's thread; with `drain`, let the running call finish (within shutdown_timeout_s)."""
        self._worker.stop()
        if drain and not self._worker.current:
            self._worker.join(self._shutdown_s)
        if not self._closed:
            self._closed = True
            heap.release()  # the frozen objects, collectable again once no replica holds them

    def nodes(self) -> tuple[str, ...]:
        return ()

    def pids(self) -> tuple[int, ...]:
        return (os.getpid(),)

    @property
    def model(self) -> Any:
        """The plugin's per-rank model (for benchmarks and tests that look inside)."""
        return self._runner.model


def _only(results: list) -> Any:
    """The one result of a batch of one (RankRunner.step_batch checked the list); an exception item is
    raised (it fails only this request)."""
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


def _device_guard(runner: RankRunner) -> Callable[[], Any] | None:
    """What makes another thread use the rank's CUDA device (the current device is per thread)."""
    device = getattr(runner.ctx, "device", None)
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    return lambda: torch.cuda.device(device)


def build_inline_runner(entry: Any, plugin_args: dict[str, Any], parallel: Any, device_config: Any) -> RankRunner:
    """The single rank of an inline replica: a world of one, no torch.distributed."""
    import torch

    from phyai_ray.process_groups import GroupSet
    from phyai_ray.rank.runner import make_context
    from placement.topology import Topology

    topology = Topology.from_parallel(parallel)
    target = device_config.resolve_target()
    device = torch.device("cuda", torch.cuda.current_device()) if target == "cuda" else torch.device("cpu")
    ctx = make_context(topology=topology, groups=GroupSet.single(topology), rank=0, replica_index=0,
                       device=device, dtype=device_config.torch_dtype(), parallel=parallel)
    return RankRunner(entry, plugin_args, ctx)
