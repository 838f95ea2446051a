"""`EngineControl`: the engine's control calls (RL loops, operators), each reaching EVERY rank of the
chosen replicas: pause / resume, sleep / wake_up, reset_cache, and the weight-update phases.

    engine.pause(mode="wait")                    # PAUSED: requests queue, the ranks drain
    engine.start_weight_update(version=3)        # UPDATING; then update_weights(buckets), then
    engine.finish_weight_update()                # back to what it was, serving version 3

Every call checks every target first (an illegal call changes nothing), then runs on all targets at
once and returns one `ControlReport` per replica; a replica that fails on the way reports FAILED and
the others carry on. The state machine of one replica is `executors/control.py`. A part of `Engine`
(engine.py), which builds it with what it uses (how to pick target replicas, whether the engine is
open, the process config's timeouts, the device type) and offers its calls as its own.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

from phyai_ray.errors import ReplicaStateError, SleepUnsupportedError
from phyai_ray.executors.control import ALL_TAGS, ControlReport

# Weight-sync phases after start_weight_update: a replica that failed since then (a rank died while the
# trainer was sending) gets a FAILED report like a failure during the call, and the others carry on.
_LATER_SYNC_PHASES = ("update_weights", "finish_weight_update")
WAIT_GRACE_S = 30.0  # a caller waits this long past a call's own timeout before giving up itself


class EngineControl:
    """The control calls of an `Engine` (see the module docstring). `targets(replicas, allow_failed)`:
    the chosen replicas (raises for a bad index or, unless `allow_failed`, a failed replica);
    `check_open()` raises once the engine is closed; `process_config`: the deployment's
    (`rpc_timeout_s`, `collective_timeout_s`); `device_type()`: "cpu" or "cuda"."""

    def __init__(self, *, targets: Callable[..., list], check_open: Callable[[], None], process_config: Any,
                 device_type: Callable[[], str]) -> None:
        self._targets, self._check_open = targets, check_open
        self._process, self._device_type = process_config, device_type

    # -- control (RL loops, operators): each call reaches EVERY rank of the chosen replicas -------
    def pause(self, mode: str = "wait", replicas: Sequence[int] | None = None,
              timeout: float | None = None) -> list[ControlReport]:
        """Stop dispatching to the replicas (PAUSED); new requests queue there until `resume()`.

        mode "wait": return once the requests at the ranks finished; "abort": also fail the queued
        ones with `RequestAbortedError`; "keep": return at once, queued requests stay queued.
        """
        if mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause(mode={mode!r}): use 'wait' (drain the ranks), 'abort' (also drop the queued "
                             "requests) or 'keep' (leave everything queued, do not wait)")
        return self._control("pause", (mode,), replicas, timeout, mode=mode)

    def resume(self, replicas: Sequence[int] | None = None, timeout: float | None = None) -> list[ControlReport]:
        """PAUSED -> SERVING; what queued meanwhile is dispatched first."""
        return self._control("resume", (), replicas, timeout)

    def sleep(self, level: int = 1, replicas: Sequence[int] | None = None,
              timeout: float | None = None) -> list[ControlReport]:
        """Drain, then free the replicas' memory (level 1 keeps weights on the host, level 2 drops them)."""
        if level not in (1, 2):
            raise ValueError(f"sleep(level={level}): level 1 keeps weights on the host, level 2 drops them")
        return self._control("sleep", (level,), replicas, timeout)

    def wake_up(self, tags: Sequence[str] | None = None, replicas: Sequence[int] | None = None,
                timeout: float | None = None) -> list[ControlReport]:
        """Bring back `tags` ("weights", "kv_cache"; None = all). Idempotent on awake replicas."""
        unknown = sorted(set(tags or ()) - ALL_TAGS)
        if unknown:
            raise ValueError(f"wake_up(tags={list(tags)}): unknown tag(s) {unknown}; use {sorted(ALL_TAGS)}")
        return self._control("wake_up", (tuple(tags) if tags else None,), replicas, timeout)

    def reset_cache(self, replicas: Sequence[int] | None = None, timeout: float | None = None) -> list[ControlReport]:
        """Drain, then call every rank's reset_cache() hook."""
        return self._control("reset_cache", (), replicas, timeout)

    def init_weight_transfer(self, backend: str = "object_store", *, master_addr: str | None = None,
                             master_port: int | None = None, group_prefix: str = "phyai-weights",
                             replicas: Sequence[int] | None = None, timeout: float | None = None,
                             wait: bool = True) -> Any:
        """Prepare the replicas to receive weights. gloo / nccl: every rank joins its replica's transfer
        group (rank 0: the trainer, which hosts the store at master_addr:master_port and joins
        concurrently, e.g. through `WeightSender`); with `wait=False` a Future of the reports."""
        from phyai_ray.rank.receive import TransferSpec, check_backend

        check_backend(backend, self._device_type())
        if backend in ("gloo", "nccl") and (master_addr is None or master_port is None):
            raise ValueError(f"init_weight_transfer({backend!r}) needs the trainer's master_addr and master_port")
        specs = {e.index: TransferSpec(backend, master_addr, master_port, f"{group_prefix}-r{e.index}",
                                       self._process.collective_timeout_s)
                 for e in self._targets(replicas)}
        return self._control("init_weight_transfer", lambda e: (specs[e.index],), replicas, timeout, wait=wait)

    def start_weight_update(self, version: Any, replicas: Sequence[int] | None = None,
                            timeout: float | None = None, lease_s: float | None = None) -> list[ControlReport]:
        """UPDATING: dispatch stops and the ranks drain; requests queue until finish_weight_update().

        The update has a lease: each next phase is due within `lease_s` (default 300 s) of the
        previous one; past it a replica that loaded nothing returns to its previous state and
        version, and one that loaded part of the update fails (it never serves mixed weights)."""
        if lease_s is not None and not lease_s > 0:
            raise ValueError(f"start_weight_update(lease_s={lease_s}): the lease must be a positive number of seconds")
        return self._control("start_weight_update", (version, lease_s), replicas, timeout)

    def update_weights(self, buckets: Sequence[Any], replicas: Sequence[int] | None = None,
                       timeout: float | None = None, wait: bool = True) -> Any:
        """Every rank receives `buckets` (from `WeightSender`) and loads them; runs concurrently with
        the trainer's send (`wait=False` returns a Future of the reports). A failure fails that replica."""
        return self._control("update_weights", (tuple(buckets),), replicas, timeout, wait=wait)

    def finish_weight_update(self, replicas: Sequence[int] | None = None,
                             timeout: float | None = None) -> list[ControlReport]:
        """Reset caches, publish the new weight version, return to the state before the update."""
        return self._control("finish_weight_update", lambda e: (e.pending_version,), replicas, timeout)

    def _control(self, op: str, args: Any, replicas: Sequence[int] | None, timeout: float | None, *,
                 mode: str = "wait", wait: bool = True) -> Any:
        """Check every target first (an illegal call changes nothing), then run `op` on all at once."""
        self._check_open()
        started = time.monotonic()
        lost: list[ControlReport] = []
        if op in _LATER_SYNC_PHASES:  # a replica that failed since its update began reports FAILED, as mid-call
            targets = self._targets(replicas, allow_failed=True)
            lost = [e.failed_report(op, e.unavailable_error(), started) for e in targets if not e.healthy]
            targets = [e for e in targets if e.healthy]
            if not targets:
                return lost if wait else _done(lost)
        else:
            targets = self._targets(replicas)
        for e in targets:
            e.check_transition(op)
        timeout_s = timeout if timeout is not None else self._process.rpc_timeout_s

        def one(e: Any) -> ControlReport:
            try:
                return e.control(op, args(e) if callable(args) else args, timeout_s=timeout_s, mode=mode)
            except (ReplicaStateError, ValueError, SleepUnsupportedError):
                raise
            except Exception as exc:  # the replica failed on the way; the others carry on
                return e.failed_report(op, exc, started)

        pool = ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix=f"phyai-{op}")
        futures = [pool.submit(one, e) for e in targets]
        pool.shutdown(wait=False)
        gathered: Future = Future()
        threading.Thread(target=_gather, args=(futures, gathered, lost), daemon=True).start()
        return gathered.result(timeout=timeout_s + WAIT_GRACE_S) if wait else gathered


def _gather(futures: list[Future], out: Future, known: Sequence[ControlReport] = ()) -> None:
    """Resolve `out` with every future's report and the `known` ones, in replica order, or the first
    exception once all have settled (each is bounded by its call's timeout), so a refusal is raised
    only when every replica is done."""
    wait(futures)
    try:
        out.set_result(sorted([*known, *(f.result() for f in futures)], key=lambda r: r.replica))
    except BaseException as exc:
        out.set_exception(exc)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
