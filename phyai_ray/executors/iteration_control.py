"""`IterationControl`: what pause, sleep and weight updates do to the iteration loop, at iteration boundaries.

Called through the loop's `quiesce` before a control op, `release` after it, `stop` when the
replica closes or fails:

    pause(mode="keep")   the loop stops between iterations; running sequences keep their state
    pause(mode="abort")  every request with a running sequence resolves now, each sequence with
                         what it has (tokens: stop_reason "aborted"); requests never admitted fail
                         with RequestAbortedError (as queued requests always did)
    pause(mode="wait"), sleep, weight updates from SERVING: admission stops, running sequences
                         finish, then the loop stops (from a stopped loop: nothing more to wait for)

On release, a sequence whose state was computed under other weights (or before a sleep) is
rebuilt from its history at its next iteration (`recompute`) when `cache_after_update="recompute"`
(the default: every later log-prob is the new weights' own); "keep" continues on the state as computed.

A part of `IterationLoop` (iterations.py) given what it uses: the loop's condition (its lock) and the
loop itself as a `LoopBooks` (its requests and running sequences, how to forget, settle and wake).
The loop reads the flags it keeps: `held`, `admitting`, `in_flight` (the loop sets it), `refusal`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Collection, Protocol

from phyai_ray.errors import RequestAbortedError
from phyai_ray.executors.sequences import GATHER

_TICK_S = 1.0  # a control wait re-reads the loop's state at least this often


class LoopBooks(Protocol):
    """What the control part asks of the loop (lock held, except `settle`)."""

    def requests(self) -> list[Any]:
        """Every request it holds, in submission order."""

    def running_sequences(self) -> Collection[Any]: ...

    def forget(self, req: Any) -> None:
        """Remove the request's sequences (running ones are dropped at the ranks next iteration)."""

    def clear(self) -> list[Any]:
        """Empty the books; the requests they held."""

    def has_work(self) -> bool:
        """Requests, or drops the ranks still owe."""

    def wake(self) -> None: ...

    def settle(self, items: list) -> None:
        """Resolve (request, value, error) items outside the lock."""


class IterationControl:
    """Holding, draining and aborting the loop between iterations (see the module docstring)."""

    def __init__(self, index: int, cond: threading.Condition, books: LoopBooks, *, recompute_after_update: bool) -> None:
        self.index, self._cond, self._books = index, cond, books
        self.recompute_after_update = recompute_after_update
        self.held = False  # no iteration starts (pause, sleep, weight update)
        self.admitting = True  # False while pause(mode="wait") lets the running sequences finish
        self.in_flight = False  # an iteration is at the ranks (set by the loop)
        self._state_dirty = False  # a sleep released the state of running sequences
        self.refusal: Callable[[], BaseException] | None = None

    def quiesce(self, op: str, mode: str, deadline: float) -> int:
        """Stop iterating as control call `op` needs (see the module docstring); returns how many
        requests pause(mode="abort") ended. Raises TimeoutError (nothing changed) past `deadline`
        (monotonic: when the control call gives up)."""
        books = self._books
        with self._cond:
            if op == "pause" and mode == "keep":
                self.held = True
                return 0
            if not self.held and (op != "pause" or mode == "wait"):
                self.admitting = False
                if not self._wait(lambda: not len(books.running_sequences()) and not self.in_flight, deadline):
                    self.admitting = True
                    self._cond.notify_all()
                    raise TimeoutError(f"replica {self.index}: {op}() waited for {len(books.running_sequences())} running sequence(s) to "
                                       "finish and ran out of time; nothing was changed (raise the timeout, or pause "
                                       "with mode='keep' or 'abort')")
            self.held = True
            if not self._wait(lambda: not self.in_flight, deadline):
                self.held = False
                self._cond.notify_all()
                raise TimeoutError(f"replica {self.index}: {op}() waited for the iteration at its ranks and ran out "
                                   "of time; nothing was changed (raise the timeout)")
            if op == "sleep":
                self._state_dirty = True
            settle = self._abort() if op == "pause" and mode == "abort" else []
        books.settle(settle)
        return len(settle)

    def _wait(self, ready: Callable[[], bool], deadline: float) -> bool:
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0 or self.refusal is not None:
                return ready()
            self._cond.wait(timeout=min(left, _TICK_S))
        return True

    def _abort(self) -> list:
        """Lock held: every request ends now: partial outputs where a sequence ran, else RequestAbortedError."""
        settle = []
        for req in self._books.requests():
            self._books.forget(req)
            if req.admitted:
                settle.append((req, GATHER, None))
            else:
                settle.append((req, None, RequestAbortedError(
                    f"replica {self.index} was paused with mode='abort'; the request was dropped before any of its "
                    "sequences reached a rank: submit it again after resume()", replica=self.index)))
        return settle

    def release(self, version: Any) -> None:
        """Iterate again; with "recompute", sequences computed under other weights (or before a sleep) rebuild."""
        with self._cond:
            if self.recompute_after_update:
                for seq in self._books.running_sequences():
                    if seq.cache_version != version or self._state_dirty:
                        seq.stale = True
            self._state_dirty = False
            self.held, self.admitting = False, True
            if self._books.has_work():
                self._books.wake()

    def stop(self, refusal: Callable[[], BaseException], *, cancel_waiting: bool = False) -> None:
        """Refuse new requests; fail (or cancel, never admitted ones) every request left."""
        with self._cond:
            if self.refusal is not None:
                return
            self.refusal = refusal
            left = self._books.clear()
            self._cond.notify_all()
        for req in left:
            if cancel_waiting and not req.admitted and req.future.cancel():
                continue
            self._books.settle([(req, None, refusal())])
