"""SerialWorker: jobs in order on one thread that ends when idle, and never a job lost on the way.

Run: `.venv/bin/pytest tests/test_serial_worker.py -q` (pure Python, no Ray)
"""

from __future__ import annotations

import queue
import threading
import time

from phyai_ray.executors.serial import SerialWorker


def test_jobs_run_in_order_on_one_thread_at_a_time():
    worker = SerialWorker("test-serial", idle_exit_s=0.001)
    seen, threads = [], set()

    def job(i: int) -> None:
        seen.append(i)
        threads.add(threading.get_ident())
    futures = [worker.call(lambda i=i: job(i)) for i in range(200)]
    for f in futures:
        f.result(timeout=5)
    assert seen == list(range(200))
    worker.stop()


class SlowEmptyQueue(queue.SimpleQueue):
    """A job queue whose `empty()` answers, then pauses: it widens the moment between the idle thread
    finding nothing queued and its ending to 50 ms, so a put lands right in it (a stand-in queue,
    named as such: the worker itself is the real one)."""

    def empty(self) -> bool:
        answer = super().empty()
        if answer:
            time.sleep(0.05)
        return answer


def test_a_job_put_while_the_idle_thread_ends_still_runs():
    """The thread decides to end (nothing queued) while a put lands: the put must start a new one."""
    worker = SerialWorker("test-serial", idle_exit_s=0.01)
    worker._jobs = SlowEmptyQueue()
    for _ in range(5):
        time.sleep(0.02)  # the thread's idle wait ran out: it is between `empty()` and ending
        assert worker.call(lambda: "ran").result(timeout=2) == "ran"
    worker.stop()
