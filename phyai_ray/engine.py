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
import threading
from concurrent.futures import Future, wait
from typing import Any

from phyai_ray.config.deployment import DeploymentConfig
from phyai_ray.config.engine import EngineArgs
from phyai_ray.dispatcher import RequestDispatcher
from phyai_ray.errors import DeploymentConfigError, EngineUnavailableError
from phyai_ray.executors import ReplicaStatus, create_executors, restart_executor
from phyai_ray.plugins.registry import resolve_plugin
from placement.topology import Topology

logger = logging.getLogger(__name__)

_WAIT_GRACE_S = 30.0  # step() waits this long past execution_timeout_s before giving up itself


class Engine:
    """Serve one plugin: `step`, `submit`, `collective_rpc`, `replica_status`, `close`. Thread-safe."""

    def __init__(self, args: EngineArgs, deployment: DeploymentConfig | None = None) -> None:
        self.args = args
        self.deployment = deployment or DeploymentConfig()
        self.entry = resolve_plugin(args.plugin)
        parallel = args.config.parallel
        self.entry.configure(args.plugin_args)
        self.entry.check_parallel(parallel)
        self.topology = Topology.from_parallel(parallel)
        self.mode: str = self.deployment.resolve_mode(self.topology.world_size)
        logger.info("phyai-ray engine: plugin=%s mode=%s replicas=%d topology: %s", self.entry.display_name(),
                    self.mode, self.deployment.replica_count, parallel.describe())
        self._dispatcher = RequestDispatcher(create_executors(self.mode, self.entry, args, self.deployment))
        self._executors = self._dispatcher.executors  # one list, shared with the dispatcher
        self._close_lock, self._restart_lock = threading.Lock(), threading.Lock()
        self._closed = False

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: Any) -> Future:
        """Validate `request` (the plugin's validator raises here), queue it on one replica, return its future.

        Raises at once, losing nothing: the validator's error; `EngineOverloadedError` when every
        healthy replica's queue is full; `EngineUnavailableError` when none is healthy. The future
        fails with `RequestTimeoutError` if no result came `execution_timeout_s` after this call.
        `future.cancel()` is True while the request still waits in the engine queue.
        """
        self._check_open()
        self.entry.validate_request(request)
        return self._dispatcher.submit(request)

    def step(self, request: Any, timeout: float | None = None) -> Any:
        """Submit and wait. `timeout` bounds the wait (default: execution_timeout_s plus a grace).

        An inline replica with nothing queued or running runs the request on this thread (no
        hand-off); it still counts as running, so other threads queue behind it and the hang clock
        fails it (and them) past execution_timeout_s even though this thread stays in the plugin.
        """
        self._check_open()
        self.entry.validate_request(request)
        future = self._dispatcher.submit(request, caller_runs=True)
        if future.done():
            return future.result()
        limit = timeout if timeout is not None else self._default_wait_s()
        try:
            return future.result(timeout=limit)
        except TimeoutError:
            if future.done():
                raise
            raise TimeoutError(f"step() waited {limit:.1f}s for a result; the request keeps its place and "
                               "its future still resolves (use submit() to keep it)") from None

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
        done, _ = wait(futures, timeout=timeout_s + _WAIT_GRACE_S)
        replies = [self._rpc_reply(e, f, done, method) for e, f in zip(targets, futures)]
        return replies[0] if replica is not None else replies

    def _rpc_targets(self, replica: int | None) -> list:
        if replica is not None and not 0 <= replica < len(self._executors):
            raise ValueError(f"replica={replica} is out of range; this engine has {len(self._executors)} replica(s)")
        targets = self._executors if replica is None else [self._executors[replica]]
        failed = [e for e in targets if not e.healthy]
        if failed:
            raise failed[0].unavailable_error()
        return targets

    @staticmethod
    def _rpc_reply(executor: Any, future: Future, done: set, method: str) -> Any:
        if future not in done:
            raise TimeoutError(f"collective_rpc({method!r}) on replica {executor.index} got no reply in time")
        return future.result()

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
            new = restart_executor(index, self.mode, self.entry, self.args, self.deployment)
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
        for executor in self._executors:
            try:
                executor.close()
            except Exception:  # keep closing the others; the cause is logged
                logger.exception("closing replica %d failed", executor.index)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineUnavailableError("the engine is closed; create a new Engine", reason="closed")

    def _default_wait_s(self) -> float:
        return self.deployment.process_config.execution_timeout_s + _WAIT_GRACE_S
