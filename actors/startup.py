"""Joining Ray (`phyai_ray.raystart.ensure_ray`) and waiting on startup replies with one deadline,
failing fast on the first error."""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import ray

from actors import fetch
from phyai_ray.errors import StartupError
from phyai_ray.raystart import ensure_ray  # noqa: F401  (the one way to join or start Ray)

logger = logging.getLogger(__name__)


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
                results[rank] = fetch.get(ref, timeout=max(left, 1.0))
            except Exception as exc:
                node = nodes[rank] if nodes else None
                raise StartupError(f"replica {replica} rank {rank}{f' (node {node[:12]})' if node else ''} "
                                   f"failed to {what}: {describe_exception(exc)}", replica=replica, rank=rank,
                                   node=node) from (getattr(exc, "cause", None) or exc)
    return [results[r] for r in range(len(refs))]
