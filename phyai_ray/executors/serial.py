"""A single daemon thread that runs jobs in submission order.

The thread is a daemon so that a plugin stuck forever (after its replica was failed) never blocks
interpreter exit. A job is a callable of no arguments that reports its own outcome; `call(fn)`
wraps one into a Future for the caller.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

_STOP = object()


class SerialWorker:
    """Runs jobs one at a time, in order, on its own thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` after the jobs already queued; its result or exception lands in the future."""
        future: Future = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
        self._jobs.put(job)
        return future

    def stop(self) -> None:
        """Let the thread exit after the job it is running (queued jobs are dropped)."""
        self._jobs.put(_STOP)

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def current(self) -> bool:
        """Whether the calling thread is this worker's thread."""
        return threading.current_thread() is self._thread

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            job()
