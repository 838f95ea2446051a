"""Joining Ray and waiting on startup replies with one deadline, failing fast on the first error."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

import ray

from phyai_ray.errors import StartupError

logger = logging.getLogger(__name__)


def ensure_ray(mode: str, deployment: Any, cpus_needed: float) -> None:
    """Use the running Ray; else join `address` (cluster) or RAY_ADDRESS, or start a local instance.

    A local instance gets at least `cpus_needed` logical CPUs: rank actors are processes, and a
    small machine may still host several CPU ranks (they then share its cores).
    """
    if ray.is_initialized():
        return
    kwargs = dict(deployment.ray_init_kwargs or {})
    address = deployment.address if mode == "cluster" else os.environ.get("RAY_ADDRESS")
    if not address:
        kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, int(cpus_needed + 0.999)))
        kwargs.setdefault("include_dashboard", False)
    logger.info("phyai-ray: %s Ray (%s)", "joining" if address else "starting a local", address or kwargs)
    ray.init(address=address, **kwargs)


def describe_exception(exc: BaseException) -> str:
    """`Type: message` of the root cause of a Ray error, one line."""
    cause = getattr(exc, "cause", None) or exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"


def gather_within(refs: Sequence[Any], deadline: float, replica: int, what: str,
                  nodes: Sequence[str] | None = None) -> list[Any]:
    """Results of `refs` (one per rank) by `deadline`; the first failure or the deadline raises StartupError."""
    pending = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = sorted(pending.values())
            raise StartupError(f"replica {replica}: rank(s) {ranks} did not {what} before the startup deadline; "
                               "raise WorkerSupervisorConfig.startup_timeout_s or check `ray status`",
                               replica=replica, rank=ranks[0])
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref, timeout=max(left, 1.0))
            except Exception as exc:
                node = nodes[rank] if nodes else None
                raise StartupError(f"replica {replica} rank {rank}{f' (node {node[:12]})' if node else ''} "
                                   f"failed to {what}: {describe_exception(exc)}", replica=replica, rank=rank,
                                   node=node) from (getattr(exc, "cause", None) or exc)
    return [results[r] for r in range(len(refs))]
