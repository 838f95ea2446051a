"""Prometheus metrics of the HTTP edge, exposed twice.

* `GET /metrics` on any group: Prometheus text from a private `CollectorRegistry` (no global
  state; scrape it like any other target; it needs the API key when one is set). The request
  counter and the per-group gauges cover EVERY group of the app (from the registry's reports,
  at most ~1 s old); the latency histogram and the in-flight gauge are the answering group's.
* Ray's own export: the same series through `ray.serve.metrics` (tagged with Serve's deployment,
  replica and application), served by every node's metrics agent on its `MetricsExportPort`
  (`ray.nodes()[i]["MetricsExportPort"]`), prefixed `ray_`, and refreshed every few seconds.

Series (per-group ones are read from the groups' reports when scraped; `engine_replica` is the
group's Serve replica id):

    phyai_requests_total{route, status}            counter (all groups, also those Serve replaced)
    phyai_request_latency_seconds{route}           histogram
    phyai_requests_in_flight                       gauge (HTTP requests being handled)
    phyai_replica_healthy{engine_replica}          gauge 1/0
    phyai_replica_in_flight{engine_replica}        gauge
    phyai_replica_served{engine_replica}           gauge (requests that returned a result)
    phyai_replica_failures{engine_replica}         gauge (requests that ended in an error)
    phyai_replica_restarts_total                   counter (in-place restarts, rebuild_failed=True)
    phyai_replica_batch_size{engine_replica}       histogram (samples per step the group's ranks ran;
                                                   Triton's exec_count / inference_count per step)
    phyai_replica_queue_wait_seconds{engine_replica}  histogram (time each request waited in the
                                                   group's engine queue before its step was dispatched)
    phyai_replica_iteration_host_seconds{engine_replica}     histograms (continuous batching: each iteration's
    phyai_replica_iteration_forward_seconds{engine_replica}  host work apart from its forward: loop_timing.py)
    phyai_replica_max_batch_size{engine_replica}   gauge (the batching in effect: samples one step may
                                                   run; 1: off; the plugin's default unless set)
    phyai_request_queue_seconds                    histogram (each request of any protocol: submission
    phyai_request_infer_seconds                    to start, start to outcome, and the samples of the
    phyai_request_batch_size                       step or iteration it started in: EngineFuture.timing)
    phyai_request_deadlines_total{outcome}         counter of requests given a deadline: met, late (ran,
                                                   finished after it), missed (never ran: DeadlineMissedError)

The two batching histograms are the answering group's (like the latency histogram), read from its
engine's scheduler at scrape time; they are filled with batching off too (every step then has 1).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

logger = logging.getLogger(__name__)

TIMING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEADLINE_OUTCOMES = ("met", "late", "missed")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
REPLICA_SERIES = (("healthy", "1 when the replica group can serve"), ("in_flight", "requests queued or running"),
                  ("served", "requests that returned a result"), ("failures", "requests that ended in an error"))


def replica_values(status: Any) -> dict[str, float]:
    return {"healthy": float(status.healthy), "in_flight": float(status.in_flight),
            "served": float(status.served), "failures": float(status.errored)}


def group_label(status: Any) -> str:
    return str(getattr(status, "group", None) or getattr(status, "index", "?"))


class _GroupCollector:
    """Per-group gauges and the app-wide request counter, read from the groups' reports at scrape time."""

    def __init__(self, statuses: Callable[[], Iterable[Any]]) -> None:
        self.statuses = statuses

    def collect(self) -> Iterable[Any]:
        from phyai_ray.serve.runtime.registry import request_totals

        statuses = list(self.statuses())
        families = {name: GaugeMetricFamily(f"phyai_replica_{name}", text, labels=["engine_replica"])
                    for name, text in REPLICA_SERIES}
        for status in statuses:
            if getattr(status, "state", "serving") == "gone":
                continue
            for name, value in replica_values(status).items():
                families[name].add_metric([group_label(status)], value)
        requests = CounterMetricFamily("phyai_requests", "HTTP requests by route and status (all groups)",
                                       labels=["route", "status"])
        for (route, status), count in sorted(request_totals(statuses).items()):
            requests.add_metric([route, status], count)
        return [requests, *families.values()]


class _BatchCollector:
    """The answering group's batch-size and queue-wait histograms, from its engine's schedulers."""

    def __init__(self, label: Callable[[], str], stats: Callable[[], list[dict[str, Any]]]) -> None:
        self.label, self.stats = label, stats

    def collect(self) -> Iterable[Any]:
        families = {"batch_size": HistogramMetricFamily(
                        "phyai_replica_batch_size", "samples per step run by the replica group's ranks",
                        labels=["engine_replica"]),
                    "queue_wait_seconds": HistogramMetricFamily(
                        "phyai_replica_queue_wait_seconds", "time a request waited in the engine queue before "
                        "its step was dispatched", labels=["engine_replica"])}
        iterations = {"iteration_host_seconds": HistogramMetricFamily(
                          "phyai_replica_iteration_host_seconds", "host time of one continuous-batching iteration: "
                          "everything but the model's forward (executors/loop_timing.py)", labels=["engine_replica"]),
                      "iteration_forward_seconds": HistogramMetricFamily(
                          "phyai_replica_iteration_forward_seconds", "the model's forward in one continuous-batching "
                          "iteration", labels=["engine_replica"])}
        limit = GaugeMetricFamily("phyai_replica_max_batch_size", "samples one step of the replica group may run "
                                  "(the batching in effect; 1: off)", labels=["engine_replica"])
        try:
            stats = self.stats()
        except Exception as exc:  # the engine is being replaced: no sample this scrape
            logger.debug("batch stats unavailable: %s", exc)
            stats = []
        for replica in stats:
            label = self.label() if len(stats) == 1 else f"{self.label()}-{replica['replica']}"
            for name, family in [*families.items(), *iterations.items()]:
                snap = replica.get(name)
                if snap is None:  # the iteration histograms: only a continuous-batching replica has them
                    continue
                buckets = [(_le(bound), float(count)) for bound, count in snap["buckets"]]
                family.add_metric([label], buckets, snap["sum"])
            limit.add_metric([label], float(replica.get("max_batch_size", 1)))
        return [*families.values(), *iterations.values(), limit]


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class EdgeMetrics:
    """Request counter, latency histogram and in-flight gauge, mirrored into Ray's metrics."""

    def __init__(self, statuses: Callable[[tuple], Iterable[Any]], own: Callable[[], Iterable[Any]],
                 batches: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        """`statuses(request_counts)`: every group's report (for /metrics); `own()`: this group's only
        (for Ray's export, which tags each Serve replica itself); `batches()`: this group's engine's
        `batch_stats()`."""
        self.statuses = lambda: statuses(self.request_counts())
        self.own = own
        self.registry = CollectorRegistry(auto_describe=True)
        self._counts: dict[tuple[str, str], int] = {}
        self.latency = Histogram("phyai_request_latency_seconds", "HTTP request latency", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("phyai_requests_in_flight", "HTTP requests being handled", registry=self.registry)
        self.rebuilds = Counter("phyai_replica_restarts", "replica groups restarted in place", registry=self.registry)
        self.latency.labels(route="/v1/step")  # the series exists before the first request
        self.queue_time = Histogram("phyai_request_queue_seconds", "time a request waited in its group before it "
                                    "started", buckets=TIMING_BUCKETS, registry=self.registry)
        self.infer_time = Histogram("phyai_request_infer_seconds", "time from a request's start to its outcome",
                                    buckets=TIMING_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("phyai_request_batch_size", "samples (sequences) of the step (iteration) a "
                                    "request started in", buckets=BATCH_BUCKETS, registry=self.registry)
        self.deadlines = Counter("phyai_request_deadlines", "requests given a deadline, by outcome: met, late, "
                                 "missed (never ran)", ["outcome"], registry=self.registry)
        for outcome in DEADLINE_OUTCOMES:
            self.deadlines.labels(outcome=outcome)
        self.registry.register(_GroupCollector(self.statuses))
        if batches is not None:
            self.registry.register(_BatchCollector(lambda: group_label(next(iter(own()))), batches))
        self._in_flight = 0
        self.ray = _RayMirror.create()

    def observe(self, route: str, status: int, seconds: float) -> None:
        key = (route, str(status))
        self._counts[key] = self._counts.get(key, 0) + 1
        self.latency.labels(route=route).observe(seconds)
        if self.ray is not None:
            self.ray.observe(route, status, seconds)

    def observe_timing(self, timing: dict[str, Any]) -> None:
        """One request's `EngineFuture.timing()` (any protocol: the group runner reports each)."""
        if timing.get("queue_ms") is not None:
            self.queue_time.observe(timing["queue_ms"] / 1e3)
        if timing.get("infer_ms") is not None:
            self.infer_time.observe(timing["infer_ms"] / 1e3)
            self.batch_size.observe(timing.get("batch_size") or 0)
        if timing.get("deadline_ms") is not None:
            outcome = "missed" if timing.get("infer_ms") is None else "met" if timing.get("deadline_met") else "late"
            self.deadlines.labels(outcome=outcome).inc()

    def request_counts(self) -> tuple[tuple[str, str, int], ...]:
        """HTTP requests this group answered, by (route, status): what it reports to the registry."""
        return tuple((route, status, count) for (route, status), count in sorted(self._counts.items()))

    def add_in_flight(self, delta: int) -> None:
        self._in_flight += delta
        self.in_flight.set(self._in_flight)
        if self.ray is not None:
            self.ray.in_flight.set(self._in_flight)

    def count_rebuild(self) -> None:
        self.rebuilds.inc()
        if self.ray is not None:
            self.ray.rebuilds.inc()

    def exposition(self) -> tuple[bytes, str]:
        """Prometheus text of the private registry; also pushes replica gauges to Ray."""
        self.refresh_ray()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def refresh_ray(self) -> None:
        if self.ray is not None:
            self.ray.replicas(self.own())


class _RayMirror:
    """The same series through `ray.serve.metrics`; absent outside a Serve replica."""

    @classmethod
    def create(cls) -> "_RayMirror | None":
        try:
            return cls()
        except Exception as exc:  # not inside a Serve replica, or Ray metrics unavailable
            logger.info("Ray metrics export disabled (%s); GET /metrics still serves them", exc)
            return None

    def __init__(self) -> None:
        from ray.serve import metrics

        self.requests = metrics.Counter("phyai_requests_total", "HTTP requests by route and status",
                                        tag_keys=("route", "status"))
        self.latency = metrics.Histogram("phyai_request_latency_seconds", "HTTP request latency",
                                         boundaries=list(LATENCY_BUCKETS), tag_keys=("route",))
        self.in_flight = metrics.Gauge("phyai_requests_in_flight", "HTTP requests being handled")
        self.rebuilds = metrics.Counter("phyai_replica_restarts_total", "replica groups restarted in place")
        self.gauges = {name: metrics.Gauge(f"phyai_replica_{name}", text, tag_keys=("engine_replica",))
                       for name, text in REPLICA_SERIES}

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.inc(1, tags={"route": route, "status": str(status)})
        self.latency.observe(seconds, tags={"route": route})

    def replicas(self, statuses: Iterable[Any]) -> None:
        for status in statuses:
            for name, value in replica_values(status).items():
                self.gauges[name].set(value, tags={"engine_replica": group_label(status)})
