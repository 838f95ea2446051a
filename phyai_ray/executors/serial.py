"""A single daemon thread that runs jobs in submission order, optionally ending when idle.

The thread is a daemon so that a plugin stuck forever (after its replica was failed) never blocks
interpreter exit. A job is a callable of no arguments that reports its own outcome; `call(fn)`
wraps one into a Future for the caller.

`idle_exit_s`: the thread ends after that long without a job and a new one starts with the next
job (order is kept: one thread at a time runs the queue). Why an inline replica wants this: every
thread that runs torch CPU ops in parallel owns an OpenMP thread pool, and once two pools exist on
a machine with no spare cores, libgomp stops spin-waiting in all of them, so each of the hundreds
of parallel regions of a small forward pays a futex wake-up (a 1.8 ms reference_dit step takes
3.3 ms). A worker that ends when idle takes its pool with it instead of slowing the caller-thread
steps that follow a burst of queued requests.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

_STOP, _RETIRE = object(), object()


class SerialWorker:
    """Runs jobs one at a time, in order, on its own thread."""

    def __init__(self, name: str, idle_exit_s: float | None = None) -> None:
        self._name, self._idle_exit_s = name, idle_exit_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards starting and ending the thread, not each job
        self._thread: threading.Thread | None = None  # the one thread that runs jobs now
        self._stopped = False
        with self._lock:
            self._start()

    def put(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)
        with self._lock:  # read under the lock, after the put: see _idle
            if self._thread is None and not self._stopped:
                self._start()

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
        self.put(job)
        return future

    def retire(self) -> None:
        """End the thread once it has run what is queued (a later job starts a new one)."""
        if self._idle_exit_s is not None:
            self._jobs.put(_RETIRE)

    def stop(self) -> None:
        """Let the thread exit after the jobs queued so far; later jobs are dropped."""
        self._stopped = True
        self._jobs.put(_STOP)

    def join(self, timeout_s: float) -> bool:
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    @property
    def current(self) -> bool:
        """Whether the calling thread is this worker's thread."""
        return threading.current_thread() is self._thread

    def _start(self) -> None:
        """Lock held: start the thread that runs the queue."""
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_exit_s)
            except queue.Empty:
                job = _RETIRE
            if job is _STOP:
                return
            if job is _RETIRE:
                if self._idle():
                    return
                continue
            job()

    def _idle(self) -> bool:
        """Lock held inside: end this thread if nothing is queued. A `put` enqueues, then reads
        `_thread` under the same lock: either its job is seen here, or the put runs after this
        thread gave up its place and starts a new one (read without the lock, a put landing between
        the check and the giving up would see this thread still there, and its job would never run)."""
        with self._lock:
            if not self._jobs.empty():
                return False
            self._thread = None
            return True
