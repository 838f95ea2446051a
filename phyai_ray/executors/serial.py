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

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable


class SerialWorker:
    """Runs jobs one at a time, in order, on its own thread."""

    def __init__(self, name: str, idle_exit_s: float | None = None) -> None:
        self._name, self._idle_exit_s = name, idle_exit_s
        self._jobs: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._stopped = self._retiring = False
        self._thread: threading.Thread | None = None  # the one thread that may run jobs now
        with self._cond:
            self._start()

    def put(self, job: Callable[[], None]) -> None:
        with self._cond:
            if self._stopped:
                return
            self._jobs.append(job)
            if self._thread is None:
                self._start()
            else:
                self._cond.notify()

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
        if self._stopped:
            future.cancel()
        return future

    def retire(self) -> None:
        """End the thread now if it has no job, else once it has none (a later job starts a new one)."""
        with self._cond:
            if self._jobs:
                self._retiring = True
            else:
                self._thread = None  # it sees it was let go and ends; `active` is False at once
            self._cond.notify_all()

    def stop(self) -> None:
        """Let the thread exit after the job it is running (queued jobs are dropped)."""
        with self._cond:
            self._stopped = True
            self._jobs.clear()
            self._cond.notify_all()

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

    @property
    def active(self) -> bool:
        """Whether a thread of this worker is running or waiting for jobs (it has not ended idle)."""
        return self._thread is not None

    def _start(self) -> None:
        """Lock held: start the thread that runs the queue."""
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._jobs and not self._stopped and self._thread is me:
                    if self._retiring or (not self._cond.wait(timeout=self._idle_exit_s) and not self._jobs
                                          and not self._stopped and self._thread is me):
                        self._thread, self._retiring = None, False  # the next put starts a new thread
                        return
                if self._stopped or self._thread is not me:
                    return
                job = self._jobs.popleft()
            job()
