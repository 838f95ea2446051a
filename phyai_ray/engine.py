"""`Engine`: the one interface, whatever the deployment.

    engine = Engine(EngineArgs(plugin="reference_dit"), DeploymentConfig.local(replica_count=2))
    future = engine.submit(request)          # concurrent.futures.Future
    result = engine.step(request)            # submit + wait
    engine.close()                           # idempotent; also `with Engine(...) as engine:`

The engine validates the topology against the plugin before anything starts, picks the backend
(`engine.mode`), and routes each whole request to one replica through the dispatcher.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Iterator, Sequence

from phyai_ray.config.deployment import DeploymentConfig
from phyai_ray.config.engine import EngineArgs
from phyai_ray.dispatcher import RequestDispatcher, affinity_of
from phyai_ray.engine_control import WAIT_GRACE_S, EngineControl
from phyai_ray.executors.control import ControlReport
from phyai_ray.errors import DeploymentConfigError, EngineUnavailableError
from phyai_ray.executors import ReplicaStatus, create_replicas, restart_replica
from phyai_ray.plugins.registry import resolve_plugin
from phyai_ray.streams import DEFAULT_MAX_BUFFERED
from phyai_ray.validation import checked
from placement.topology import Topology

logger = logging.getLogger(__name__)



class Engine:
    """Serve one plugin: `step`, `submit`, `collective_rpc`, `replica_status`, `close`; the control calls
    (pause, sleep, weight updates) are its `EngineControl` part's (engine_control.py). Thread-safe."""

    def __init__(self, args: EngineArgs, deployment: DeploymentConfig | None = None) -> None:
        self.args = args
        self.deployment = deployment or DeploymentConfig()
        self.entry = resolve_plugin(args.plugin)
        parallel = args.config.parallel
        self.entry.configure(args.plugin_args)
        self.entry.check_parallel(parallel)
        batching = self.deployment.batching.resolve(getattr(self.entry, "default_max_batch_size", 1))
        self.deployment = self.deployment.model_copy(update={"batching": batching})  # what is in effect
        self.topology = Topology.from_parallel(parallel)
        self.mode: str = self.deployment.resolve_mode(self.topology.world_size)
        logger.info("phyai-ray engine: plugin=%s mode=%s replicas=%d topology: %s", self.entry.display_name(),
                    self.mode, self.deployment.replica_count, parallel.describe())
        self._dispatcher = RequestDispatcher(create_replicas(self.mode, self.entry, args, self.deployment),
                                             affinity_slack=self.deployment.affinity_slack)
        self._executors = self._dispatcher.replicas  # one list of `Replica`s, shared with the dispatcher
        self._close_lock, self._restart_lock = threading.Lock(), threading.Lock()
        self._closed = False
        self._batching = self.deployment.batching.enabled and self.mode != "external"
        self._wait_s = self._default_wait_s()
        self._controls = EngineControl(targets=self._rpc_targets, check_open=self._check_open,
                                       process_config=self.deployment.process_config,
                                       device_type=lambda: self.device_type)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: Any, session: Any = None, *, deadline_s: float | None = None,
               late: str | None = None) -> Future:
        """Validate `request` (the plugin's validator), queue it on one replica, return its future.

        A `phyai_ray.validation.Validated` request is not validated again: it runs in the form the
        validator returned (what the serving edges pass on). Raises at once, losing nothing:
        `RequestRejectedError` when the validator refused it; `EngineOverloadedError` when every
        healthy replica's queue is full; `EngineUnavailableError` when none is healthy. The future
        fails with `RequestTimeoutError` if no result came `execution_timeout_s` after this call.
        `future.cancel()` is True while the request still waits in the engine queue. The future
        carries `replica` (where it was queued) and `weight_version` (of that replica when the
        request reached its ranks). Requests with the same `session` key go to the same replica
        while it serves (see `RequestDispatcher.submit`).

        `deadline_s` (seconds from now): the request's own deadline. It orders the replica's queue
        (BatchingConfig.scheduling "deadline": earliest first), and a request that has not started by
        then fails with `DeadlineMissedError` without running; nor does one that the replica's recent
        step time says cannot finish by then (finish-by admission). `future.timing()` says whether it was met.
        `late`: "finish" (deliver a result ready after the deadline) or "drop" (answer DeadlineMissedError
        instead: fail closed); None: `BatchingConfig.late`.
        """
        self._check_open()
        request = checked(self.entry, request)
        key, size = self._batch_tags(request)
        affinity = affinity_of(self.entry, request) if self.deployment.routing == "affinity" else None
        return self._dispatcher.submit(request, session, key=key, size=size, deadline=_deadline(deadline_s),
                                       late=self._late(late), affinity=affinity)

    def step(self, request: Any, timeout: float | None = None, session: Any = None, *,
             deadline_s: float | None = None, late: str | None = None) -> Any:
        """Submit and wait. `timeout` bounds the wait (default: execution_timeout_s plus a grace when it is
        set; else no bound here: the replica's own clocks, the hang limit of every rank call and the
        request's deadline or estimate, give every request an outcome).

        An inline replica with nothing queued or running and batching off runs the request on this
        thread (no hand-off; with batching on its worker thread does, at once); it still counts as
        running, so other threads queue behind it and the hang clock fails it (and them) past
        the hang limit (rank_call_timeout_s) even though this thread stays in the plugin.
        `deadline_s` and `late` as for `submit`.
        """
        self._check_open()
        request = checked(self.entry, request)
        # the per-step path: the helpers' calls only where they have work (a deadline, batching, a late)
        key, size = self._batch_tags(request) if self._batching else (None, 1)
        late = self.deployment.batching.late if late is None else late
        future = self._dispatcher.submit(request, session, caller_runs=True, key=key, size=size,
                                         deadline=None if deadline_s is None else _deadline(deadline_s),
                                         late=late if late == "finish" else _checked_late(late))
        limit = timeout if timeout is not None else self._wait_s  # done: no wait at all
        try:
            return future.result(timeout=None if limit == math.inf else limit)
        except TimeoutError:
            if future.done():
                raise
            raise TimeoutError(f"step() waited {limit:.1f}s for a result; the request keeps its place and "
                               "its future still resolves (use submit() to keep it)") from None

    def _late(self, late: str | None) -> str:
        """A request's `late`, checked: as given, else `BatchingConfig.late`."""
        return _checked_late(late if late is not None else self.deployment.batching.late)

    def _batch_tags(self, request: Any) -> tuple[Any, int]:
        """(batch key, samples) of a request from the plugin's `batch_key` / `request_size`, checked here."""
        if not self._batching:
            return None, 1
        key, size = self.entry.batch_key(request), self.entry.request_size(request)
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"plugin {self.entry.display_name()}: batch_key returned an unhashable "
                            f"{type(key).__name__} ({key!r:.80}); return a tuple, str or number") from None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"plugin {self.entry.display_name()}: request_size returned {size!r}; it must be an "
                             "int >= 1 (the samples the request carries)")
        return key, size

    def batch_stats(self) -> list[dict[str, Any]]:
        """Per replica: histograms of samples per step and of each request's queue wait (seconds); with the
        iteration protocol, of sequences per iteration and each sequence's wait for a slot, plus the
        running and waiting sequences now."""
        size = self.deployment.batching.max_batch_size or 1
        return [{"replica": e.index, "batching": e.batching or e.iterative,
                 "max_batch_size": size if e.batching else 1, **e.batch_stats()}
                for e in list(self._executors)]

    def stream(self, request: Any, *, session: Any = None, max_buffered: int = DEFAULT_MAX_BUFFERED,
               timeout: float | None = None, deadline_s: float | None = None) -> Iterator[Any]:
        """Yield the output rank's partial outputs as the plugin produces them (its `stream(request, emit)`).

        The generator's return value (`StopIteration.value`) is the request's final result. Leaving
        the loop early (break, close(), garbage collection) cancels: every rank stops at the same
        step and the replica is free for the next request. At most `max_buffered` chunks wait
        unread. `timeout` bounds the whole stream (default: execution_timeout_s plus a grace).
        `deadline_s` (seconds from now): its first chunk must come by then, else DeadlineMissedError
        (as `open_stream`); a stream with its first chunk streams on to its end.
        """
        future, reader = self.open_stream(request, session=session, max_buffered=max_buffered, deadline_s=deadline_s)
        return (yield from self.read_stream(future, reader, timeout, deadline_s))

    def read_stream(self, future: Future, reader: Any, timeout: float | None = None,
                    deadline_s: float | None = None) -> Iterator[Any]:
        """`stream`'s loop over a stream `open_stream` opened: its chunks, then (as the generator's
        value) its result; leaving early cancels it. `timeout` bounds the whole stream; with
        `deadline_s`, a stream with no chunk that long after this call is cancelled, DeadlineMissedError."""
        deadline = time.monotonic() + (timeout if timeout is not None else self._default_wait_s())
        first_by = None if deadline_s is None else time.monotonic() + deadline_s
        done = False
        try:
            while not done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"stream() passed its {timeout or self._default_wait_s():.1f}s deadline")
                wait_s = min(left, 0.5) if first_by is None else min(left, 0.5, max(first_by - time.monotonic(), 0))
                chunks, done = reader.read(wait_s)
                if chunks:
                    first_by = None
                elif first_by is not None and not done and time.monotonic() >= first_by:
                    from phyai_ray.async_streams import first_chunk_late
                    raise first_chunk_late(deadline_s)
                yield from chunks
                if not done and future.done() and future.exception() is not None:
                    raise future.exception()
            left = deadline - time.monotonic()  # the reader may end a moment before the future is set
            return future.result(timeout=None if left == math.inf else max(left, 0.1))
        finally:
            if not done:
                reader.cancel()

    @property
    def batches_per_iteration(self) -> bool:
        """Whether the replicas run the plugin's iteration protocol (continuous batching)."""
        return bool(self._executors) and all(e.iterative for e in self._executors)

    def open_stream(self, request: Any, *, session: Any = None, max_buffered: int = DEFAULT_MAX_BUFFERED,
                    deadline_s: float | None = None) -> tuple[Future, Any]:
        """The parts `stream` is built on, for consumers with a loop of their own: the request's future
        and a reader (`phyai_ray.streams.LocalReader` describes the protocol): `read(timeout_s) ->
        (chunks, done)`, `cancel()`, and `subscribe(wake)`, True when the reader calls `wake()` after
        every chunk and at the end, so an asyncio consumer needs no thread per stream
        (`phyai_ray.async_streams.stream_items`). `deadline_s` (seconds from now): its first chunk's
        deadline; the iteration loop admits it only if an iteration fits and drops it past the
        deadline without a chunk (a step-path stream is held to it by its reader: `read_stream`)."""
        self._check_open()
        request = checked(self.entry, request)
        deadline = _deadline(deadline_s)
        return self._dispatcher.route(lambda e: e.submit_stream(request, max_buffered, deadline), session)

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None, replica: int | None = None,
                       all_ranks: bool = False, **kwargs: Any) -> Any:
        """Call `method` of the per-rank model on every rank of one replica (`replica=i`) or of all.

        Returns the output rank's reply (every rank's, in rank order, with `all_ranks=True`);
        for `replica=None`, a list with one entry per replica.
        """
        self._check_open()
        timeout_s = timeout if timeout is not None else self.deployment.process_config.rpc_timeout_s
        targets = self._rpc_targets(replica)
        futures = [e.collective_rpc(method, args, kwargs, timeout_s, all_ranks) for e in targets]
        done, _ = wait(futures, timeout=timeout_s + WAIT_GRACE_S)
        replies = [self._rpc_reply(e, f, done, method) for e, f in zip(targets, futures)]
        return replies[0] if replica is not None else replies

    def _rpc_targets(self, replica: int | Sequence[int] | None, allow_failed: bool = False) -> list:
        chosen = [replica] if isinstance(replica, int) else (range(len(self._executors)) if replica is None
                                                             else list(replica))
        bad = [r for r in chosen if not 0 <= r < len(self._executors)]
        if bad or not chosen:
            raise ValueError(f"replica={replica} is out of range; this engine has {len(self._executors)} replica(s)")
        targets = [self._executors[r] for r in chosen]
        failed = [e for e in targets if not e.healthy]
        if failed and not allow_failed:
            raise failed[0].unavailable_error()
        return list(targets)

    @staticmethod
    def _rpc_reply(replica: Any, future: Future, done: set, method: str) -> Any:
        if future not in done:
            raise TimeoutError(f"collective_rpc({method!r}) on replica {replica.index} got no reply in time")
        return future.result()

    # -- control (RL loops, operators): EngineControl's calls, each reaching EVERY rank of the replicas --
    def pause(self, mode: str = "wait", replicas: Sequence[int] | None = None,
              timeout: float | None = None) -> list[ControlReport]:
        """PAUSED: requests queue until `resume()`; mode "wait", "abort" or "keep" (EngineControl.pause)."""
        return self._controls.pause(mode, replicas, timeout)

    def resume(self, replicas: Sequence[int] | None = None, timeout: float | None = None) -> list[ControlReport]:
        """PAUSED -> SERVING; what queued meanwhile is dispatched first."""
        return self._controls.resume(replicas, timeout)

    def sleep(self, level: int = 1, replicas: Sequence[int] | None = None,
              timeout: float | None = None) -> list[ControlReport]:
        """Drain, then free the replicas' memory (level 1 keeps weights on the host, level 2 drops them)."""
        return self._controls.sleep(level, replicas, timeout)

    def wake_up(self, tags: Sequence[str] | None = None, replicas: Sequence[int] | None = None,
                timeout: float | None = None) -> list[ControlReport]:
        """Bring back `tags` ("weights", "kv_cache"; None = all). Idempotent on awake replicas."""
        return self._controls.wake_up(tags, replicas, timeout)

    def reset_cache(self, replicas: Sequence[int] | None = None, timeout: float | None = None) -> list[ControlReport]:
        """Drain, then call every rank's reset_cache() hook."""
        return self._controls.reset_cache(replicas, timeout)

    def init_weight_transfer(self, backend: str = "object_store", *, master_addr: str | None = None,
                             master_port: int | None = None, group_prefix: str = "phyai-weights",
                             replicas: Sequence[int] | None = None, timeout: float | None = None,
                             wait: bool = True) -> Any:
        """Prepare the replicas to receive weights (gloo / nccl: each joins its transfer group, rank 0 the
        trainer's at master_addr:master_port); `wait=False`: a Future of the reports."""
        return self._controls.init_weight_transfer(backend, master_addr=master_addr, master_port=master_port,
                                                   group_prefix=group_prefix, replicas=replicas, timeout=timeout,
                                                   wait=wait)

    def start_weight_update(self, version: Any, replicas: Sequence[int] | None = None,
                            timeout: float | None = None, lease_s: float | None = None) -> list[ControlReport]:
        """UPDATING until finish_weight_update(); each next phase is due within `lease_s` (default 300 s)."""
        return self._controls.start_weight_update(version, replicas, timeout, lease_s)

    def update_weights(self, buckets: Sequence[Any], replicas: Sequence[int] | None = None,
                       timeout: float | None = None, wait: bool = True) -> Any:
        """Every rank receives `buckets` (from `WeightSender`) and loads them; `wait=False`: a Future."""
        return self._controls.update_weights(buckets, replicas, timeout, wait)

    def finish_weight_update(self, replicas: Sequence[int] | None = None,
                             timeout: float | None = None) -> list[ControlReport]:
        """Reset caches, publish the new weight version, return to the state before the update."""
        return self._controls.finish_weight_update(replicas, timeout)

    @property
    def device_type(self) -> str:
        """cpu or cuda: where the ranks compute."""
        return self.args.config.device.resolve_target()

    # -- status -----------------------------------------------------------------------------
    def replica_status(self) -> list[ReplicaStatus]:
        """Per-replica health, queued / dispatched / served / errored counts and failure cause.

        Never waits on a step or a queue: it reads counters kept by each replica's scheduler.
        """
        out = []
        for e in list(self._executors):
            counts, f = e.counts(), e.failure
            out.append(ReplicaStatus(
                index=e.index, healthy=e.healthy, world_size=e.world_size, in_flight=counts.in_flight,
                served=counts.served, errored=counts.errored, queued=counts.queued, dispatched=counts.dispatched,
                state=e.state.value, weight_version=e.weight_version,
                failure=str(f) if f else None, failure_reason=f.reason if f else None,
                failed_rank=f.rank if f else None, nodes=e.nodes(), pids=e.pids()))
        return out

    @property
    def healthy(self) -> bool:
        """Whether at least one replica can serve."""
        return not self._closed and any(e.healthy for e in self._executors)

    @property
    def replica_count(self) -> int:
        return len(self._executors)

    def restart_replica(self, index: int) -> None:
        """Replace FAILED replica `index` with a fresh group on the same plan (local/cluster only).

        The engine never does this on its own; it is for the layer that owns the engine (a Serve
        ingress, an RL loop) after reading `replica_status()`. Blocks until the new group is ready
        (startup_timeout_s); on failure the replica stays failed and the error is raised.
        """
        self._check_open()
        if self.mode not in ("local", "cluster"):
            raise DeploymentConfigError(f"restart_replica needs Ray replica groups; this engine runs {self.mode!r}, "
                                        "create a new Engine instead")
        if not 0 <= index < len(self._executors):
            raise ValueError(f"replica={index} is out of range; this engine has {len(self._executors)} replica(s)")
        with self._restart_lock:
            old = self._executors[index]
            if old.healthy:
                raise ValueError(f"replica {index} is healthy; only a failed replica can be restarted")
            old.close()  # idempotent: ranks killed, placement group removed before the new one is placed
            new = restart_replica(index, self.mode, self.entry, self.args, self.deployment)
            with self._close_lock:
                if self._closed:
                    new.close()
                    raise EngineUnavailableError("the engine was closed during restart_replica", reason="closed")
                self._dispatcher.replace(index, new)
        logger.info("replica %d restarted", index)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Fail or cancel unfinished work, stop every worker, release placement groups. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for replica in self._executors:
            try:
                replica.close()
            except Exception:  # keep closing the others; the cause is logged
                logger.exception("closing replica %d failed", replica.index)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineUnavailableError("the engine is closed; create a new Engine", reason="closed")

    def _default_wait_s(self) -> float:
        """execution_timeout_s plus a grace when it is set; else no bound (math.inf)."""
        cap = self.deployment.process_config.execution_timeout_s
        return math.inf if cap is None else cap + WAIT_GRACE_S


def _checked_late(late: str) -> str:
    """`late` as given, once checked: "finish" or "drop"."""
    if late not in ("finish", "drop"):
        raise ValueError(f"late={late!r} must be 'finish' (deliver a result ready after its deadline) or 'drop' "
                         "(answer DeadlineMissedError instead), e.g. engine.submit(request, deadline_s=0.1, late='drop')")
    return late


def _deadline(deadline_s: float | None) -> float | None:
    """A request's own deadline, `deadline_s` seconds from now, as a monotonic time (checked here)."""
    if deadline_s is None:
        return None
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
        raise ValueError(f"deadline_s={deadline_s!r} must be a number of seconds > 0 (or None for no deadline)")
    return time.monotonic() + float(deadline_s)
