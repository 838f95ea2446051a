"""Inline executor: the plugin runs in the caller's process, on one thread, with no Ray.

`submit` returns at once; requests run in order on the executor's thread, so queued ones can be
cancelled. A plugin exception fails only its request. A request still unfinished
`execution_timeout_s` after submission fails the executor (a stuck plugin cannot be interrupted),
and every later request raises `EngineUnavailableError`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.base import ReplicaExecutor, fail_future
from phyai_ray.executors.deadlines import DeadlineWatch
from phyai_ray.executors.serial import SerialWorker
from phyai_ray.worker import RankRunner

logger = logging.getLogger(__name__)


class InlineExecutor(ReplicaExecutor):
    """One rank in the caller's process."""

    mode = "inline"

    def __init__(self, build_runner: Callable[[], RankRunner], *, index: int = 0, world_size: int = 1,
                 execution_timeout_s: float, startup_timeout_s: float, shutdown_timeout_s: float = 10.0) -> None:
        super().__init__(index, world_size)
        self._timeout_s, self._shutdown_s = execution_timeout_s, shutdown_timeout_s
        self._pending: dict[Future, float] = {}  # unfinished call -> its time limit (s)
        self._lock = threading.Lock()
        self._worker = SerialWorker(name=f"phyai-{self.mode}-{index}")
        self._watch = DeadlineWatch(self._expired, name=f"phyai-{self.mode}-{index}-deadlines")
        started = self._worker.submit(build_runner)
        try:
            self._runner: RankRunner = started.result(timeout=startup_timeout_s)
        except TimeoutError:
            self.close()
            raise TimeoutError(f"{self.mode} plugin creation took longer than startup_timeout_s="
                               f"{startup_timeout_s}; raise WorkerSupervisorConfig.startup_timeout_s") from None
        except BaseException:
            self.close()
            raise

    def submit(self, request: Any) -> Future:
        return self._enqueue(lambda: self._runner.step(request), self._timeout_s)

    def collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout_s: float,
                       all_ranks: bool = False) -> Future:
        outer: Future = Future()
        inner = self._enqueue(lambda: self._runner.call(method, args, kwargs), timeout_s)
        inner.add_done_callback(lambda f: _relay(f, outer, all_ranks))
        return outer

    def _enqueue(self, fn: Callable[[], Any], timeout_s: float) -> Future:
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                raise self.unavailable_error()
            self._pending[future] = timeout_s
        future.add_done_callback(self._forget)
        self._watch.add(future, time.monotonic() + timeout_s)
        return self._worker.submit(fn, future)

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.pop(future, None)

    def _expired(self, future: Future) -> None:
        with self._lock:
            limit = self._pending.get(future, self._timeout_s)
        self._fail(EngineUnavailableError(
            f"{self.mode} replica {self.index}: a call exceeded its deadline of {limit}s counted from submission "
            "(execution_timeout_s for requests, the timeout of collective_rpc); the plugin may be stuck, so the "
            "replica no longer serves",
            reason="timeout", replica=self.index, rank=0))

    def _fail(self, error: EngineUnavailableError) -> None:
        if not self._set_failure(error):
            return
        logger.error("%s", error)
        self._fail_pending()
        self._worker.stop()
        self._watch.close()

    def _fail_pending(self) -> None:
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            fail_future(future, self.unavailable_error())

    def close(self) -> None:
        """Cancel queued work, let the running call finish (bounded), fail what is left."""
        error = EngineUnavailableError(f"{self.mode} replica {self.index} is closed", reason="closed",
                                       replica=self.index)
        if not self._set_failure(error):
            return
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.cancel()
        self._worker.stop()
        self._worker.join(self._shutdown_s)
        self._fail_pending()
        self._watch.close()


def _relay(inner: Future, outer: Future, all_ranks: bool) -> None:
    if inner.cancelled():
        outer.cancel()
    elif inner.exception() is not None:
        fail_future(outer, inner.exception())
    else:
        outer.set_result([inner.result()] if all_ranks else inner.result())


def build_inline_runner(entry: Any, plugin_args: dict[str, Any], parallel: Any, device_config: Any) -> RankRunner:
    """The single rank of an inline replica: a world of one, no torch.distributed."""
    import torch

    from phyai_ray.groups import GroupSet
    from phyai_ray.worker import make_context
    from placement.topology import Topology

    topology = Topology.from_parallel(parallel)
    target = device_config.resolve_target()
    device = torch.device("cuda", torch.cuda.current_device()) if target == "cuda" else torch.device("cpu")
    ctx = make_context(topology=topology, groups=GroupSet.single(topology), rank=0, replica_index=0,
                       device=device, dtype=device_config.torch_dtype(), parallel=parallel)
    return RankRunner(entry, plugin_args, ctx)
