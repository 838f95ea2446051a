"""A single daemon thread that runs jobs in submission order, each tied to a Future.

Queued jobs can be cancelled through their future. The thread is a daemon so that a plugin stuck
forever (after its deadline failed the executor) never blocks interpreter exit.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from phyai_ray.executors.base import fail_future, resolve_future

_STOP = object()


class SerialWorker:
    """Runs `fn()` jobs one at a time in order; results land in the returned futures."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], future: Future | None = None) -> Future:
        future = future or Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        """Let the thread exit after the job it is running (queued jobs are dropped)."""
        self._jobs.put(_STOP)

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, future = job
            if not _start(future):
                continue  # cancelled, or failed by a deadline or close, while queued
            try:
                value = fn()
            except BaseException as exc:  # the plugin's own exception goes to the caller as is
                fail_future(future, exc)
            else:
                resolve_future(future, value)


def _start(future: Future) -> bool:
    """Mark a queued job's future running; False when it already finished (it must not run)."""
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # already FINISHED: failed by the deadline watch or by close()
        return False
