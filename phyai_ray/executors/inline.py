"""Inline executor: the plugin runs in the caller's process, on one thread, with no Ray.

The same scheduler as a Ray replica group (queue, `max_queued_requests`, two clocks, exact
accounting), dispatching ONE request at a time to the plugin's thread: a hand-off in one process
costs microseconds, so nothing is gained by pipelining, and every request still waiting can be
cancelled. A plugin exception fails only its request. A request past its deadline fails with
`RequestTimeoutError` and the replica keeps serving; only a call RUNNING longer than its limit
fails the replica (a stuck plugin cannot be interrupted), and every later request then raises
`EngineUnavailableError`.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable

from phyai_ray.executors.base import ReplicaExecutor
from phyai_ray.work import Work
from phyai_ray.executors.serial import SerialWorker
from phyai_ray.streams import ChunkSink, LocalReader
from phyai_ray.work import Kind
from phyai_ray.worker import RankRunner

logger = logging.getLogger(__name__)


class InlineExecutor(ReplicaExecutor):
    """One rank in the caller's process."""

    mode = "inline"
    skips_expired = True  # one rank: a request whose deadline passed before it started is skipped
    worker_idle_exit_s: float | None = 0.5  # see SerialWorker: no second OpenMP pool left behind

    def __init__(self, build_runner: Callable[[], RankRunner], *, index: int = 0, world_size: int = 1,
                 execution_timeout_s: float, startup_timeout_s: float, shutdown_timeout_s: float = 10.0,
                 max_queued: int | None = None, max_ongoing: int | None = 1, batching: Any = None) -> None:
        super().__init__(index, world_size, max_ongoing=max_ongoing, max_queued=max_queued,
                         step_limit_s=execution_timeout_s)
        self._shutdown_s = shutdown_timeout_s
        self._worker = SerialWorker(name=f"phyai-{self.mode}-{index}", idle_exit_s=self.worker_idle_exit_s)
        started = self._worker.call(build_runner)
        try:
            self._runner: RankRunner = started.result(timeout=startup_timeout_s)
        except TimeoutError:
            self.close()
            raise TimeoutError(f"{self.mode} plugin creation took longer than startup_timeout_s="
                               f"{startup_timeout_s}; raise WorkerSupervisorConfig.startup_timeout_s") from None
        except BaseException:
            self.close()
            raise
        self._device_guard = _device_guard(self._runner)
        self.enable_batching(batching, self._runner.batchable)
        self.enable_iterations(self._runner.entry, batching, self._runner.iterative)
        if self.worker_idle_exit_s is not None:
            self._worker.retire()  # the plugin was built; the first step may run on the caller's thread

    def submit(self, request: Any, *, caller_runs: bool = False, key: Any = None, size: int = 1,
               due: float | None = None) -> Future:
        """As every replica; with `caller_runs` and nothing queued or running, run it on this thread.

        The scheduler counts it as dispatched while it runs, so a request from another thread
        queues behind it (one call at a time, in order) and the hang clock fails the replica if
        this call runs past its limit: the other callers get the error; this thread is in the
        plugin and returns when it does.
        """
        if not caller_runs or self.frontend.iterative:
            return super().submit(request, key=key, size=size, due=due)
        self._check_healthy()
        future = self.scheduler.submit(Kind.STEP, request, self._step_limit_s, here=True, key=key, size=size, due=due)
        work = future.work
        if work.here:
            if self._device_guard is None:
                self._run(work)
            else:
                with self._device_guard():
                    self._run(work)
        return future

    def run_iteration(self, plan: Any) -> Future:
        """On the loop's own thread when nothing else is at the rank (no hand-off per iteration), else
        right after what is. Never held by the scheduler: the loop itself stops at pause and sleep."""
        future = self.scheduler.submit(Kind.ITERATE, plan, self._step_limit_s, bypass_queue=True, here=True)
        if future.work.here:
            self._guarded(self._run, future.work)
        return future

    def _launch(self, work: Work) -> None:
        self._worker.put(lambda: self._guarded(self._run, work))

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` with the rank's CUDA device current (a fresh worker thread starts on device 0)."""
        if self._device_guard is None:
            return fn(*args)
        with self._device_guard():
            return fn(*args)

    def _run(self, work: Work) -> None:
        """On the plugin's thread: run `work` unless its deadline already failed it (one rank: safe)."""
        if self.skips_expired and not work.unfinished:
            self.scheduler.finished(work)
            return
        if self._failure is not None:
            self.scheduler.complete(work, error=self.unavailable_error())
            return
        try:
            value = self._execute(work)
        except BaseException as exc:  # the plugin's own exception goes to the caller as is
            self.scheduler.complete(work, error=exc)
        else:
            self.scheduler.complete(work, value)

    def _submit_stream(self, request: Any, max_buffered: int) -> tuple[Future, Any]:
        sink = ChunkSink(max_buffered)
        future = self.scheduler.submit(Kind.STREAM, (request, sink), self._step_limit_s)
        return future, LocalReader(sink, future)

    def _execute(self, work: Work) -> Any:
        if work.kind == Kind.STEP and self.batching:  # a batch of one: an exception item fails the request
            return _only(self._runner.execute(Kind.BATCH, [work.payload]))
        if work.kind == Kind.STREAM:
            request, sink = work.payload
            return self._runner.execute(Kind.STREAM, request, sink)
        value = self._runner.execute(work.kind, work.payload)
        return [value] if work.kind == Kind.CALL and work.all_ranks else value

    def _control_ranks(self, op: str, args: tuple, timeout_s: float) -> Future:
        """On the plugin's thread (idle: control calls drain first, except pause(mode="keep"))."""
        return self._worker.call(lambda: [self._guarded(self._runner.control, op, self.rank_args(op, args, 0))])

    def _teardown(self) -> None:
        self._worker.stop()

    def _teardown_after_failure(self) -> None:
        self._teardown()

    def close(self) -> None:
        """Cancel queued work, let the running call finish (bounded), fail what is left."""
        if not self._set_failure(self._closed_error()):
            return
        self._stop_iterations(cancel_waiting=True)
        self.scheduler.stop(self.unavailable_error, cancel_queued=True, fail_dispatched=False)
        self._worker.stop()
        if not self._worker.current:
            self._worker.join(self._shutdown_s)
        self.scheduler.stop(self.unavailable_error, cancel_queued=True)


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
    from phyai_ray.worker import make_context
    from placement.topology import Topology

    topology = Topology.from_parallel(parallel)
    target = device_config.resolve_target()
    device = torch.device("cuda", torch.cuda.current_device()) if target == "cuda" else torch.device("cpu")
    ctx = make_context(topology=topology, groups=GroupSet.single(topology), rank=0, replica_index=0,
                       device=device, dtype=device_config.torch_dtype(), parallel=parallel)
    return RankRunner(entry, plugin_args, ctx)
