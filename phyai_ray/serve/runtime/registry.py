"""`GroupRegistry`: where the groups of one app report their state, so any group can show all of them.

Every Serve replica of the group deployment (one replica group each) sends a `GroupReport` every
`REPORT_INTERVAL_S` and gets back the reports of all groups. `/v1/replicas` and `/metrics` answer
from that copy, whichever group the proxy picked, with no Serve private API. A group that stops
reporting (Serve replaced or removed it) stays listed as `gone`, with its last state and failure
cause, for `KEEP_GONE_S`; its request counts stay in the app's totals.

The registry is a small deployment of the same app (one replica, no CPU): Serve starts it with
the app and removes it with the app.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

REPORT_INTERVAL_S = 0.5
GONE_AFTER_S = 5.0  # no report for this long: the group was replaced or removed
KEEP_GONE_S = 120.0
FAILED_STAT = "phyai_failed"  # key of a group's record_routing_stats: True while its group has failed

RELAYED_FAILURE_S = 10.0  # how long a failure another group relayed counts here (routing stats take over)
_failed_in_process: dict[str, float] = {}  # group -> until when this process's routers skip it


def set_failed(group: str, failed: bool) -> None:
    """Tell every router of this process (the handle a failed group forwards through) about its own `group`."""
    if failed:
        _failed_in_process[group] = float("inf")
    else:
        _failed_in_process.pop(group, None)


def note_failed(groups: tuple[str, ...]) -> None:
    """Failures another group relayed with a forwarded request; they count for RELAYED_FAILURE_S."""
    until = time.monotonic() + RELAYED_FAILURE_S
    for group in groups:
        if _failed_in_process.get(group, 0.0) < until:
            _failed_in_process[group] = until


def failed_here(group: str) -> bool:
    return _failed_in_process.get(group, 0.0) > time.monotonic()


@dataclass(frozen=True)
class GroupReport:
    """One group's state as its Serve replica sees it."""

    group: str  # the Serve replica's unique id
    state: str  # "starting" (Serve does not route to it yet), "serving", "failed", or (set here) "gone"
    world_size: int
    in_flight: int = 0
    sessions: int = 0  # long-lived sessions open on it (openpi WebSockets, streamed responses)
    queued: int = 0
    dispatched: int = 0
    served: int = 0
    errored: int = 0
    failure: str | None = None
    failure_reason: str | None = None
    failed_rank: int | None = None
    nodes: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()
    replica_pid: int = 0
    rebuilds: int = 0
    requests: tuple[tuple[str, str, int], ...] = ()  # (route, status, count) of HTTP requests it answered
    direct_host: str | None = None  # under Serve's direct ingress: the address of its own HTTP port...
    direct_port: int | None = None  # ...which it reads from its own listening socket (None: not enabled)
    seen: float = field(default=0.0, compare=False)  # when the registry last heard from it

    @property
    def healthy(self) -> bool:
        return self.state == "serving"

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("requests", "seen")}
        return {**out, "healthy": self.healthy, "nodes": list(self.nodes), "pids": list(self.pids)}


class GroupRegistry:
    """The reports of every group of the app, newest first-seen order kept."""

    def __init__(self) -> None:
        self._groups: dict[str, GroupReport] = {}

    def report(self, report: GroupReport) -> list[GroupReport]:
        """Record `report`; return every group's latest report."""
        self._groups[report.group] = replace(report, seen=time.monotonic())
        return self.snapshot()

    def snapshot(self) -> list[GroupReport]:
        now = time.monotonic()
        for key, old in list(self._groups.items()):
            if now - old.seen > KEEP_GONE_S:
                del self._groups[key]
            elif now - old.seen > GONE_AFTER_S and old.state != "gone":
                self._groups[key] = replace(old, state="gone", in_flight=0, sessions=0, queued=0, dispatched=0,
                                            direct_host=None, direct_port=None)
        return list(self._groups.values())


def request_totals(reports: list[GroupReport]) -> dict[tuple[str, str], int]:
    """HTTP requests by (route, status), summed over every group the registry knows."""
    totals: dict[tuple[str, str], int] = {}
    for report in reports:
        for route, status, count in report.requests:
            totals[(route, status)] = totals.get((route, status), 0) + count
    return totals


def takers(reports: list[GroupReport], passed: tuple[str, ...]) -> list[GroupReport] | None:
    """The groups that can take a request a failed group forwards: serving, not among the `passed`
    groups (those it already went through), not known failed in this process. None when `reports`
    is empty: no registry view yet, so only the router can tell.

        A failed (passed), B serving, C starting   ->  [B]
        A failed (passed), B failed, C starting    ->  []   (wait for Serve to bring one up)
    """
    if not reports:
        return None
    return [r for r in reports if r.healthy and r.group not in passed and not failed_here(r.group)]


def describe(reports: list[GroupReport]) -> str:
    """Each group and its state, for an error message: `abc: serving, def: failed (worker_exit)`."""
    parts = [f"{r.group}: {r.state}" + (f" ({r.failure_reason})" if r.failure_reason else "") for r in reports]
    return ", ".join(parts) or "no group known"
