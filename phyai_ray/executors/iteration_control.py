"""The control half of the iteration loop: what pause, sleep and weight updates do at iteration boundaries.

Called by the replica's control calls (`quiesce` before the op, `release` after it, `stop` when
the replica closes or fails):

    pause(mode="keep")   the loop stops between iterations; running sequences keep their state
    pause(mode="abort")  every request with a running sequence resolves now, each sequence with
                         what it has (tokens: stop_reason "aborted"); requests never admitted fail
                         with RequestAbortedError (as queued requests always did)
    pause(mode="wait"), sleep, weight updates from SERVING: admission stops, running sequences
                         finish, then the loop stops (from a stopped loop: nothing more to wait for)

On release, a sequence whose state was computed under other weights (or before a sleep) is
rebuilt from its history at its next iteration (`recompute`) when `cache_after_update="recompute"`
(the default: every later log-prob is the new weights' own); "keep" continues on the state as computed.

`IterationControl` is the base of `IterationLoop` (iterations.py): it owns the control flags and
shares the loop's lock and books; `_forget`, `_settle` and `_wake` are the loop's.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from phyai_ray.errors import RequestAbortedError

_TICK_S = 1.0  # a control wait re-reads the loop's state at least this often
GATHER = object()  # a settled request whose result is still to be gathered (outside the lock)


class IterationControl:
    """Holding, draining and aborting the loop between iterations (see the module docstring)."""

    index: int
    _cond: threading.Condition

    def _init_control(self, recompute_after_update: bool) -> None:
        self.recompute_after_update = recompute_after_update
        self._held = False  # no iteration starts (pause, sleep, weight update)
        self._admitting = True  # False while pause(mode="wait") lets the running sequences finish
        self._in_flight = False  # an iteration is at the ranks
        self._state_dirty = False  # a sleep released the state of running sequences
        self._refusal: Callable[[], BaseException] | None = None

    def quiesce(self, op: str, mode: str, deadline: float) -> int:
        """Stop iterating as control call `op` needs (see the module docstring); returns how many
        requests pause(mode="abort") ended. Raises TimeoutError (nothing changed) past `deadline`
        (monotonic: when the control call gives up)."""
        with self._cond:
            if op == "pause" and mode == "keep":
                self._held = True
                return 0
            if not self._held and (op != "pause" or mode == "wait"):
                self._admitting = False
                if not self._wait(lambda: not self._running and not self._in_flight, deadline):
                    self._admitting = True
                    self._cond.notify_all()
                    raise TimeoutError(f"replica {self.index}: {op}() waited for {len(self._running)} running "
                                       "sequence(s) to finish and ran out of time; nothing was changed (raise the "
                                       "timeout, or pause with mode='keep' or 'abort')")
            self._held = True
            if not self._wait(lambda: not self._in_flight, deadline):
                self._held = False
                self._cond.notify_all()
                raise TimeoutError(f"replica {self.index}: {op}() waited for the iteration at its ranks and ran out "
                                   "of time; nothing was changed (raise the timeout)")
            if op == "sleep":
                self._state_dirty = True
            settle = self._abort() if op == "pause" and mode == "abort" else []
        self._settle(settle)
        return len(settle)

    def _wait(self, ready: Callable[[], bool], deadline: float) -> bool:
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0 or self._refusal is not None:
                return ready()
            self._cond.wait(timeout=min(left, _TICK_S))
        return True

    def _abort(self) -> list:
        """Lock held: every request ends now: partial outputs where a sequence ran, else RequestAbortedError."""
        settle = []
        for req in list(self._requests):
            self._forget(req)
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
                for seq in self._running.values():
                    if seq.cache_version != version or self._state_dirty:
                        seq.stale = True
            self._state_dirty = False
            self._held, self._admitting = False, True
            if self._requests or self._to_drop:
                self._wake()

    def stop(self, refusal: Callable[[], BaseException], *, cancel_waiting: bool = False) -> None:
        """Refuse new requests; fail (or cancel, never admitted ones) every request left."""
        with self._cond:
            if self._refusal is not None:
                return
            self._refusal = refusal
            left = list(self._requests)
            self._requests.clear()
            self._queued = 0
            self._waiting.clear()
            self._n_waiting = 0
            self._running.clear()
            self._deadlines.clear()
            self._cond.notify_all()
        for req in left:
            if cancel_waiting and not req.admitted and req.future.cancel():
                continue
            self._settle([(req, None, refusal())])
