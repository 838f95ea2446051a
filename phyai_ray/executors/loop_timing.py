"""Where one iteration's time goes: the forward, and the host work around it (the loop's and the ranks').

    engine (IterationLoop)      loop_s       plan the iteration, then apply its deltas and settle requests
    engine -> ranks -> engine   round_s      the plan sent to the reply back (transport + the rank's part)
    rank (RankRunner.iterate)   plan_s       drops, recomputes, admits, turns
                                iterate_s    the per-rank model's iterate()
    per-rank model              forward_s    its own forward, when its `Deltas(forward_s=...)` says
                                             (else the whole iterate() counts as the forward)

    host_s    = loop_s + (round_s - iterate_s) + (iterate_s - forward_s)    everything but the forward
    forward_s = the model's forward (its device work, on CPU its math)

On a GPU a decode step of an 8B model at batch 64 takes a few milliseconds: the host work is added to
every token unless it hides behind the forward, so it is measured apart, per iteration, inline and on
Ray groups. `IterationTimes.snapshot()` gives p50 / p99 of both and the median of each part; the
engine's `batch_stats()` carries it (`iteration_host_ms`, `iteration_forward_ms`, `iteration_parts_ms`)
and the HTTP edge exports the two as histograms (`phyai_replica_iteration_host_seconds`,
`phyai_replica_iteration_forward_seconds`).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterable

from phyai_ray.executors.batching import Histogram
from phyai_ray.plugins.iteration import RankTiming

ITERATION_BOUNDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 10.0)
PARTS = ("loop", "transport", "rank_plan", "rank_host", "forward")


class IterationTimes:
    """The latest iterations' parts (seconds), and histograms of host and forward time since the start."""

    def __init__(self, keep: int = 2048) -> None:
        self._lock = threading.Lock()
        self._parts: deque[tuple[float, float, float, float, float]] = deque(maxlen=keep)
        self.host = Histogram(ITERATION_BOUNDS)
        self.forward = Histogram(ITERATION_BOUNDS)

    def record(self, loop_s: float, round_s: float, rank: RankTiming | None) -> None:
        """One iteration: the loop's own work, the round trip, and what the rank said of its part (None:
        a reply without timing, e.g. a failed iteration: the round trip counts as the forward)."""
        if rank is None:
            parts = (loop_s, 0.0, 0.0, 0.0, round_s)
        else:
            forward = rank.iterate_s if rank.forward_s is None else min(rank.forward_s, rank.iterate_s)
            transport = max(round_s - rank.plan_s - rank.iterate_s, 0.0)
            parts = (loop_s, transport, rank.plan_s, rank.iterate_s - forward, forward)
        with self._lock:
            self._parts.append(parts)
            self.host.observe(sum(parts[:4]))
            self.forward.observe(parts[4])

    def snapshot(self) -> dict[str, Any]:
        """{iteration_host_ms: {p50, p99}, iteration_forward_ms: {p50, p99}, iteration_parts_ms: {part: p50},
        iteration_host_share: median host / (host + forward)} over the latest iterations; None when none ran."""
        with self._lock:  # a copy under the lock (record() takes it every iteration); the sorting after
            parts = list(self._parts)
            histograms = {"iteration_host_seconds": self.host.snapshot(),
                          "iteration_forward_seconds": self.forward.snapshot()}
        if not parts:
            return {"iteration_host_ms": None, "iteration_forward_ms": None, "iteration_parts_ms": None,
                    "iteration_host_share": None, **histograms}
        host = sorted(sum(p[:4]) for p in parts)
        forward = sorted(p[4] for p in parts)
        shares = sorted(sum(p[:4]) / max(sum(p), 1e-12) for p in parts)
        return {"iteration_host_ms": quantiles_ms(host), "iteration_forward_ms": quantiles_ms(forward),
                "iteration_parts_ms": {name: _ms(_median(sorted(p[i] for p in parts))) for i, name in enumerate(PARTS)},
                "iteration_host_share": round(_median(shares), 4), **histograms}


def _median(values: list[float]) -> float:
    return values[len(values) // 2]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def quantiles_ms(seconds: Iterable[float]) -> dict[str, float | None]:
    """{p50, p99} in milliseconds of `seconds` (None each when there are none)."""
    values = sorted(seconds)
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": _ms(values[len(values) // 2]), "p99": _ms(values[min(int(0.99 * len(values)), len(values) - 1)])}
