"""Done-callbacks on a real Ray replica: one that raises anything or blocks cannot stop the others.

Run: `.venv/bin/pytest tests/test_callbacks.py` (starts one local Ray instance for the session).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import wait

import pytest

from phyai_ray.executors import futures as delivery

def test_callback_thread_keeps_order_and_moves_on_past_a_stalled_callback():
    """Pure: the delivery thread alone, with a short stall bound."""
    thread, out, release = delivery.CallbackThread("test-callbacks", stall_s=0.2), [], threading.Event()
    thread.post(lambda _: release.wait(10), None)
    posted = time.monotonic()
    for i in range(5):
        thread.post(out.append, i)
    thread.post(_raise(SystemExit(2)), None)  # logged, delivery goes on
    thread.post(out.append, 5)
    while len(out) < 6 and time.monotonic() - posted < 5:
        time.sleep(0.01)
    release.set()
    assert out == [0, 1, 2, 3, 4, 5] and time.monotonic() - posted < 0.2 + 1.0


def test_an_awaiting_coroutine_never_waits_behind_a_blocked_callback_and_its_cancel_reaches_the_future():
    """Pure: an EngineFuture whose delivery thread is held by a user callback; `awaitable` still wakes at once."""
    thread, release = delivery.CallbackThread("test-callbacks", stall_s=30.0), threading.Event()
    thread.post(lambda _: release.wait(10), None)  # the delivery thread is busy for 10 s
    cancelled = []
    future = delivery.EngineFuture(thread, lambda f: cancelled.append(f))
    other = delivery.EngineFuture(thread, lambda f: cancelled.append(f))

    async def main() -> tuple[float, bool]:
        waiting = delivery.awaitable(future)
        threading.Timer(0.05, future.set_result, args=("done",)).start()
        start = time.monotonic()
        assert await asyncio.wait_for(waiting, 5) == "done"
        late = time.monotonic() - start
        pending = delivery.awaitable(other)
        pending.cancel()
        await asyncio.sleep(0.05)
        return late, other.cancelled()
    try:
        late, other_cancelled = asyncio.run(main())
    finally:
        release.set()
    assert late < 1.0 and other_cancelled and cancelled == [other]


def _engine():
    from tests.test_transport import _engine

    return _engine("ipc")


def _stall_s() -> float:
    return getattr(delivery, "STALL_S", 2.0)


def _delivered(engine, request: dict) -> tuple[float, threading.Event]:
    """Submit `request` with a callback; (when its future finished, the event its callback sets)."""
    ran = threading.Event()
    future = engine.submit(request)
    future.add_done_callback(lambda f: ran.set())
    wait([future], timeout=30)
    return time.monotonic(), ran


def _awaited(future, timeout_s: float):
    """The result of `future` awaited on an asyncio loop, as Serve and `EngineActor` wait for it."""
    async def waiter():
        return await asyncio.wait_for(delivery.awaitable(future), timeout_s)
    return asyncio.run(waiter())


def _raise(exc: BaseException):
    def callback(future):
        raise exc
    return callback


@pytest.mark.ray
def test_a_callback_that_raises_anything_does_not_stop_later_callbacks(ray_session):
    with _engine() as engine:
        for exc in (SystemExit(3), KeyboardInterrupt(), RuntimeError("boom")):
            engine.submit({"sleep": 0}).add_done_callback(_raise(exc))
            _, ran = _delivered(engine, {"sleep": 0})
            assert ran.wait(10), f"a callback raising {type(exc).__name__} stopped the replica's later callbacks"
        assert _awaited(engine.submit({"sleep": 0}), 10).tolist() == [3.0] * 2


@pytest.mark.ray
def test_a_blocking_callback_delays_others_at_most_the_stall_bound_and_asyncio_waiters_not_at_all(ray_session):
    started, release = threading.Event(), threading.Event()

    def block(future):
        started.set()
        release.wait(60)

    with _engine() as engine:
        try:
            engine.submit({"sleep": 0}).add_done_callback(block)
            assert started.wait(10)
            # an asyncio waiter never waits behind user callbacks (the blocked one holds delivery for 60 s)
            asked = time.monotonic()
            assert _awaited(engine.submit({"sleep": 0.05}), 5).tolist() == [3.0] * 2
            assert time.monotonic() - asked < _stall_s(), "the waiter waited behind the blocked callback"
            finished, ran = _delivered(engine, {"sleep": 0})
            assert ran.wait(_stall_s() + 5), "a blocking callback stalled every later callback of its replica"
            assert time.monotonic() - finished < _stall_s() + 2.0
            _, again = _delivered(engine, {"sleep": 0})
            assert again.wait(5)  # delivery goes on, on a fresh thread
        finally:
            release.set()
