"""`WeightSender`: the trainer's side of the four-phase weight sync, for any backend.

    sender = WeightSender("gloo")      # or "object_store" (no group), "nccl", "cuda_ipc" (same GPU, GPU only)
    sender.init_transfer(target)                        # once: ranks (and this process) join groups
    reports = sender.update(target, model.named_parameters(), version=step)

`target` is an `Engine` in this process or an `EngineActor` handle. `update` runs
`start_weight_update(version, lease_s)`, then `update_weights(buckets)` on the replicas while this
process sends the buckets, then `finish_weight_update()` on the replicas that received everything.
A replica that fails on the way is FAILED (reported, never served half-updated); the others finish.
An update whose names, shapes or dtypes do not match the model is refused before any weight
changes: `update` raises `WeightUpdateRefusedError` and every replica keeps its previous version.
If this process dies mid-update, the lease (default: three times `timeout_s`) ends it on the
replicas.

A list of targets is one fleet: `update([engine_a, engine_b, actor_c], params, version=v)` stages
the weights on every rank while the fleet serves v - 1, verifies a digest of what each rank
received, and switches every replica together, or rolls all back (`phyai_ray.rl.fleet`; it needs no
`init_transfer`).

vLLM-style code can call the phases itself: `engine.update_weights(sender.prepare(params),
wait=False)`, then `sender.send()`, then wait and `engine.finish_weight_update()`.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

from phyai_ray.rank.receive import Bucket, check_backend
from phyai_ray.rl.transfer import DEFAULT_BUCKET_BYTES, flatten, plan_buckets, share_cuda

logger = logging.getLogger(__name__)


class _Target:
    """An Engine, or an EngineActor handle, behind one calling convention."""

    def __init__(self, target: Any, pool: ThreadPoolExecutor, wait_s: float) -> None:
        self.target, self._pool, self._wait_s = target, pool, wait_s
        self.remote = hasattr(getattr(target, "replica_status", None), "remote")

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """`name(*args, **kwargs)` on the target; TimeoutError past the sender's deadline (+30 s of slack)."""
        return self.start(name, *args, **kwargs).result(timeout=self._wait_s)

    def start(self, name: str, *args: Any, **kwargs: Any) -> Future:
        if self.remote:
            return getattr(self.target, name).remote(*args, **kwargs).future()
        return self._pool.submit(getattr(self.target, name), *args, **kwargs)


class WeightSender:
    """Flattens `named_parameters()` into size-capped buckets and delivers them to rollout replicas."""

    def __init__(self, backend: str = "object_store", *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 master_addr: str | None = None, timeout_s: float = 120.0, lease_s: float | None = None) -> None:
        check_backend(backend, "cuda" if backend in ("nccl", "cuda_ipc") else "cpu")
        self.backend, self.bucket_bytes, self.timeout_s = backend, bucket_bytes, timeout_s
        self.lease_s = lease_s if lease_s is not None else 3 * timeout_s
        self.master_addr = master_addr
        self._store: Any = None
        self._groups: dict[int, Any] = {}  # replica -> this process's member (rank 0) of its group
        self._pending: list[tuple[Bucket, list[Any]]] = []
        self._shared: list[Any] = []  # cuda_ipc: flat buckets that must outlive the ranks' copies
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="phyai-sender")  # calls on an Engine

    # -- phase 0 ---------------------------------------------------------------------------------
    def init_transfer(self, target: Any, replicas: list[int] | None = None) -> list:
        """Prepare the replicas (and, for gloo / nccl, join one group per replica as its rank 0)."""
        t = self._target(target)
        if self.backend in ("object_store", "cuda_ipc"):
            return t.call("init_weight_transfer", self.backend, replicas=replicas, timeout=self.timeout_s)
        import torch.distributed as dist

        sizes = {s.index: s.world_size for s in _statuses(t) if replicas is None or s.index in replicas}
        self.master_addr = self.master_addr or _node_ip()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = dist.TCPStore(self.master_addr, 0, 1 + sum(sizes.values()), True, timeout=timeout,
                                    wait_for_workers=False)
        prefix = f"phyai-weights-{uuid.uuid4().hex[:8]}"
        pending = t.start("init_weight_transfer", self.backend, master_addr=self.master_addr,
                          master_port=self._store.port, group_prefix=prefix, replicas=list(sizes),
                          timeout=self.timeout_s)
        with ThreadPoolExecutor(max_workers=len(sizes)) as pool:
            joins = {i: pool.submit(self._join, prefix, i, n + 1) for i, n in sizes.items()}
        reports = pending.result(timeout=self.timeout_s + 30)
        for i, join in joins.items():
            if join.exception() is None:
                self._groups[i] = join.result()
            else:
                logger.error("weight transfer group of replica %d: %s", i, join.exception())
        return reports

    def _target(self, target: Any) -> _Target:
        return _Target(target, self._pool, self.timeout_s + 30)

    def _join(self, prefix: str, replica: int, size: int) -> Any:
        import torch.distributed as dist

        store = dist.PrefixStore(f"{prefix}-r{replica}", self._store)
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, 0, size)
        return dist.ProcessGroupGloo(store, 0, size, datetime.timedelta(seconds=self.timeout_s))

    # -- phases 1-3 --------------------------------------------------------------------------------
    def update(self, target: Any, named_parameters: Iterable[tuple[str, Any]], version: Any,
               replicas: list[int] | None = None) -> Any:
        """start_weight_update(version) -> update_weights while sending -> finish_weight_update; a list
        of targets: one verified fleet update (`phyai_ray.rl.fleet.update_fleet`, a `FleetReport`)."""
        if isinstance(target, (list, tuple)):
            from phyai_ray.rl.fleet import update_fleet

            return update_fleet([self._target(t) for t in target], named_parameters, version,
                                bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s)
        t = self._target(target)
        buckets = self.prepare(named_parameters)  # before the start: a bad tensor here leaves replicas untouched
        try:
            started = t.call("start_weight_update", version, replicas=replicas, timeout=self.timeout_s,
                             lease_s=self.lease_s)
            chosen = [r.replica for r in started if r.error is None]
            receiving = t.start("update_weights", buckets, replicas=chosen, timeout=self.timeout_s)
            unreached = self.send(chosen)
            received = receiving.result(timeout=self.timeout_s + 30)  # raises WeightUpdateRefusedError
            done = [r.replica for r in received if r.error is None and r.replica not in unreached]
            finished = t.call("finish_weight_update", replicas=done, timeout=self.timeout_s) if done else []
        finally:
            self._shared.clear()  # every rank copied its weights (or refused them): the shared buckets may go
        by_replica = {r.replica: r for r in [*started, *received, *finished]}
        return [by_replica[i] for i in sorted(by_replica)]

    def prepare(self, named_parameters: Iterable[tuple[str, Any]]) -> list[Bucket]:
        """Plan the buckets; object_store puts each one now (one copy, shared by every rank)."""
        self._pending = plan_buckets(named_parameters, self.bucket_bytes)
        if self.backend == "cuda_ipc":
            import torch

            self._shared = [flatten(ts, torch.device("cuda", torch.cuda.current_device())) for _, ts in self._pending]
            return [Bucket(b.dtype, b.numel, b.tensors, ipc=share_cuda(flat))
                    for (b, _), flat in zip(self._pending, self._shared)]
        if self.backend != "object_store":
            return [b for b, _ in self._pending]
        import ray

        return [Bucket(b.dtype, b.numel, b.tensors, ray.put(flatten(ts))) for b, ts in self._pending]

    def send(self, replicas: list[int] | None = None) -> set[int]:
        """Broadcast the prepared buckets to each replica's group (gloo / nccl); returns the replicas
        whose group broke on the way (their update fails on the replica side too)."""
        broken: set[int] = set()
        if self.backend in ("object_store", "cuda_ipc"):
            return broken
        targets = sorted(self._groups) if replicas is None else [r for r in replicas if r in self._groups]
        broken |= set(replicas or ()) - set(targets)
        device = "cuda" if self.backend == "nccl" else "cpu"
        for _, tensors in self._pending:
            flat = flatten(tensors, device)
            for replica in targets:
                if replica in broken:
                    continue
                try:
                    self._groups[replica].broadcast(flat, 0).wait()
                except Exception as exc:  # that replica's rank died or timed out: only it fails
                    logger.error("weight broadcast to replica %d failed: %s", replica, exc)
                    broken.add(replica)
                    self._groups.pop(replica, None)
        return broken


def _statuses(t: _Target) -> list:
    return t.call("replica_status")


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"
