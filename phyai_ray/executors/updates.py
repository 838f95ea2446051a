"""All-or-nothing weight updates of one replica: checks first, a lease, no waking without weights.

    start_weight_update(v, lease_s)   UPDATING; the lease starts: the trainer's next phase is due
                                      within lease_s (each update_weights renews it)
    update_weights(buckets)           1. every rank checks every name, shape and dtype against its
                                         model; nothing is received, nothing changes
                                      2. a mismatch on any rank refuses the update: broadcast
                                         buckets are drained (the trainer's send completes), the
                                         replica returns to its previous state and version, and
                                         `WeightUpdateRefusedError` names each tensor and shape
                                      3. else every rank loads the buckets one by one
    finish_weight_update()            refused unless an update_weights completed since the start
    lease expired                     nothing was loaded: back to the previous state and version;
                                      something was: the replica FAILS (it never serves mixed
                                      weights, nor new weights under the old version)
    wake_up() after sleep(level=2)    refused (`ReplicaStateError`) until an update refilled every
                                      weight the sleep dropped: "load weights first"
    update_weights((STAGED,))         nothing is received: every rank already staged the weights of
                                      this version beside its live ones (a fleet update,
                                      `phyai_ray.rl.fleet`); finish_weight_update() then publishes
                                      the version and each rank's model switches to them at once

A collaborator of `ReplicaControl` (control.py), which builds it with what it uses and calls it
under its control lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from phyai_ray.errors import EngineUnavailableError, ReplicaStateError, WeightUpdateRefusedError
from phyai_ray.rank.receive import Bucket

logger = logging.getLogger(__name__)
STAGED = Bucket("staged", 0, ())  # update_weights((STAGED,)): switch to what every rank staged (no transfer)

DEFAULT_LEASE_S = 300.0
_LEASE_LOCK_WAIT_S = 900.0  # a control call in progress ends within its own timeout first


@dataclass
class _Update:
    """The weight update in progress on one replica."""

    version: Any
    lease_s: float
    expires: float = 0.0
    touched: bool = False  # some rank may have loaded part of it
    complete: bool = False  # the last update_weights finished on every rank
    timer: threading.Timer | None = None
    notes: tuple[str, ...] = ()  # what the ranks accepted differently than sent (skipped, cast)


class WeightUpdates:
    """The weight-update phases of one replica's state machine (see the module docstring).

    Given by its `ReplicaControl`: the replica's `life` (its `_Lifecycle` record: state, the states to
    return to, the update in progress), `fan_out(op, args, deadline)` (a control op on every rank;
    fails the replica if a rank fails), `fail(error)`, `restore_dispatch()` (serve again when back in
    SERVING), `failure()`, `weight_version()` and the control lock (the lease's timer takes it)."""

    def __init__(self, index: int, life: Any, *, fan_out: Callable[[str, tuple, float], list],
                 fail: Callable[[EngineUnavailableError], None], restore_dispatch: Callable[[], None],
                 failure: Callable[[], EngineUnavailableError | None], weight_version: Callable[[], Any],
                 control_lock: threading.Lock) -> None:
        self.index, self._life, self._fan_out, self._fail = index, life, fan_out, fail
        self._restore_dispatch, self._failure, self._weight_version = restore_dispatch, failure, weight_version
        self._control_lock = control_lock

    def update_weights(self, buckets: tuple, deadline: float) -> list:
        """Check on every rank, then load, or refuse with nothing changed."""
        update = self._life.update
        if tuple(buckets) == (STAGED,):  # the weights are on the ranks already: nothing to check or receive
            ranks = self._fan_out("update_weights", ((),), deadline)
            update.complete = True
            return ranks
        if not buckets:
            raise ValueError(f"replica {self.index}: update_weights() got no buckets; nothing was changed")
        checks = self._fan_out("check_weights", (buckets,), deadline)
        problems = _problems(checks)
        if problems:
            self._refuse(update, buckets, problems, deadline)
        update.touched, update.complete = True, False
        update.notes = tuple(dict.fromkeys(update.notes + tuple(_problems(checks, "notes"))))
        if update.notes:
            logger.info("replica %d: weight update to version %r: %s", self.index, update.version,
                        "; ".join(update.notes))
        ranks = self._fan_out("update_weights", (buckets,), deadline)
        update.complete = True
        return ranks

    def _refuse(self, update: _Update, buckets: tuple, problems: list[str], deadline: float) -> None:
        if any(getattr(b, "ref", 0) is None and getattr(b, "ipc", 0) is None for b in buckets):
            self._fan_out("drain_weights", (buckets,), deadline)  # the trainer's broadcast completes
        listed = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        if update.touched:  # an earlier update_weights of this update loaded part of it
            error = EngineUnavailableError(
                f"replica {self.index}: a later part of the weight update to version {update.version!r} does not match "
                f"the model ({listed}) after an earlier part was loaded; the replica was stopped so it never serves "
                "mixed weights", reason="exception", replica=self.index)
            self._fail(error)
            raise error
        self.end_update()
        self._restore_dispatch()
        raise WeightUpdateRefusedError(
            f"replica {self.index} refused the weight update to version {update.version!r}: {listed}. Nothing was "
            f"changed: it serves version {self._weight_version()!r} with its previous weights ({self._life.state.value}); "
            "send tensors named and shaped as the model's weights, in its dtypes, in a new update",
            replica=self.index, version=update.version, serving_version=self._weight_version(),
            problems=tuple(problems))

    def check_complete(self) -> None:
        update = self._life.update
        if update is None or not update.complete:
            raise ReplicaStateError(
                f"replica {self.index}: finish_weight_update() refused: no update_weights() completed since "
                f"start_weight_update({self._life.pending_version!r}); send the weights first (its lease returns "
                "the replica to its previous state and version if none arrive)", replica=self.index,
                state=self._life.state.value, op="finish_weight_update")

    def check_weights_loaded(self, tags: Any, deadline: float) -> None:
        """wake_up after sleep(level=2): every dropped weight must have been loaded again."""
        if not self._life.weights_dropped or (tags is not None and "weights" not in tags):
            return
        missing = _problems(self._fan_out("unloaded_weights", (), deadline))
        if missing:
            raise ReplicaStateError(
                f"replica {self.index} slept with level=2, which dropped its weights, and {len(missing)} of them were "
                f"not loaded since (e.g. {missing[:3]}): load weights first (start_weight_update, update_weights, "
                "finish_weight_update), then wake_up(); nothing was changed", replica=self.index,
                state=self._life.state.value, op="wake_up")
        self._life.weights_dropped = False

    # -- the lease -----------------------------------------------------------------------------------
    def start_lease(self, version: Any, lease_s: float) -> None:
        self._life.update = _Update(version, float(lease_s))
        self.renew_lease()

    def renew_lease(self) -> None:
        update = self._life.update
        if update.timer is not None:
            update.timer.cancel()
        update.expires = time.monotonic() + update.lease_s
        update.timer = threading.Timer(update.lease_s, self._lease_expired, args=(update,))
        update.timer.name, update.timer.daemon = f"phyai-replica-{self.index}-lease", True
        update.timer.start()

    def end_update(self) -> None:
        """The update is over (finished, refused, or its lease returned the replica): leave UPDATING."""
        life = self._life
        if life.update is not None and life.update.timer is not None:
            life.update.timer.cancel()
        life.update, life.pending_version = None, None
        life.state = life.before.pop()

    def _lease_expired(self, update: _Update) -> None:
        """The timer's thread: past the lease, return an untouched replica, fail one that loaded anything."""
        if not self._control_lock.acquire(timeout=_LEASE_LOCK_WAIT_S):
            self._fail(self._lease_error(update, "and a control call held the replica past it"))
            return
        try:
            if self._life.update is not update or self._failure() is not None or time.monotonic() < update.expires:
                return  # finished, refused, renewed or failed meanwhile
            if update.touched:
                self._fail(self._lease_error(update, "after part of it was sent"))
                return
            logger.warning("replica %d: the weight update to version %r received nothing within its lease of %.1fs; "
                           "back to %s at version %r", self.index, update.version, update.lease_s,
                           self._life.before[-1].value, self._weight_version())
            self.end_update()
            self._restore_dispatch()
        finally:
            self._control_lock.release()

    def _lease_error(self, update: _Update, when: str) -> EngineUnavailableError:
        return EngineUnavailableError(
            f"replica {self.index}: the weight update to version {update.version!r} was not finished within its lease "
            f"({update.lease_s:.1f}s after its last phase) {when}; the new weights may be loaded in part, so the "
            f"replica was stopped and never serves mixed weights (restart_replica({self.index}) replaces it)",
            reason="timeout", replica=self.index)


def _problems(replies: list, kind: str = "problems") -> list[str]:
    """Every rank's problems (or `notes`) of its `WeightCheck` reply, each distinct one once, in rank order."""
    from phyai_ray.rank.receive import WeightCheck

    seen: list[str] = []
    for reply in replies:
        for problem in getattr(reply, kind) if isinstance(reply, WeightCheck) else ():
            if problem not in seen:
                seen.append(problem)
    return seen
