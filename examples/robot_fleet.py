"""A fleet of simulated robots, each its own process, acting from chunks of a served flow policy.

    phyai-ray serve reference_flow_policy --device cpu --cpus-per-rank 0.5 &      # or any openpi server
    .venv-clients/bin/python examples/robot_fleet.py --url ws://127.0.0.1:8000/v1/openpi --robots 8 --hz 20

Each robot (a process with `openpi_client.WebsocketClientPolicy`, the package index's client, which
pins numpy < 2: run this file with a Python that has it, e.g. the tests' `.venv-clients`) executes
one action every 1/hz seconds from its action queue. When the queue falls to `--threshold` of a
chunk (LeRobot's `chunk_size_threshold`), it sends the next frame on a thread while it keeps
executing, with real-time chunking fields:

    prev_actions       the actions still queued (not executed when the frame leaves)
    inference_delay    the actions it expects to execute while the frame is inferred (from the
                       latency it measured so far), so the server keeps exactly those
    deadline_ms        when its queue runs dry: the frame is useless after that
    late               "drop" (`--late`): a chunk ready after the deadline is not sent; the server
                       answers deadline_missed instead (fail closed)

When the reply comes, the actions executed meanwhile are skipped and the rest replace the queue,
unless the chunk is stale (`stale()`: the reply says its deadline was missed): then the robot
discards it, keeps its queue and counts it in `stale_discarded` (0 from a server that drops late
chunks itself).

Failover: a session lives on one replica group. When that group fails, the server answers the
frame with an error saying "connect again" and closes the connection (or the connection just
closes). The robot keeps executing its queue, opens a fresh `WebsocketClientPolicy` to the same
URL (Serve's proxy hands it to a healthy group; a connection that still lands on the failed group
is refused the same way and the robot tries again every RETRY_S) and sends the frame again, built
from the queue as it is now: its unexecuted actions as `prev_actions` with `inference_delay` (one
action more than its latency says: a new session's first frame may be forwarded, or meet a busier
group), so the new group's chunk starts with the frozen prefix and continues the old chunk. Attempts stop
after `--reconnect-s` from the failure, with an error naming the URL, the attempts and the last
error. A frame with no answer after `--frame-timeout-s` counts as a lost session too.

Each robot reports: frames sent, on time (back before its queue ran dry), idle ticks (the queue was
empty: the robot stood still), the latency p50 / p99, whether the frozen prefix came back as sent,
the seam (`seam()`: how far the first executed action of a new chunk is from the one the old queue
held there) of ordinary chunks and of the first chunk after each failover (with how many actions
its frame took past its inference_delay, `late_by`, and, for ordinary chunks, `past_prefix()`: the
seam they would show as late), reconnects, the longest
gap between two chunks, and every chunk's arrival time, group and whether that group forwarded it.
The parent prints one line per robot and the fleet's totals (`--report-file`: every robot's whole
report as JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

RETRY_S = 0.05  # between attempts to open a session while a failed group's robots move to a healthy one


class NoSessionError(ConnectionError):
    """No group took the robot's session before its reconnect deadline."""


def stale(reply: dict) -> bool:
    """Whether a reply's chunk must not be executed: its `server_timing` says the deadline was missed."""
    timing = reply.get("server_timing") or {}
    return timing.get("deadline_met") is False


def session_lost(exc: BaseException) -> bool:
    """Whether an `infer` error ended the session (the connection closed, or the server's error frame
    says to connect again: its group failed), not just this frame (a missed deadline, a bad
    observation: the session goes on)."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and text.startswith("Error in inference server"):
        return "connect again" in text
    return True


def seam(actions: Any, prev: Any, done: int) -> float | None:
    """max |actions[done] - prev[done]|: the first action the robot executes from the new chunk (it
    skips the `done` it executed while the frame was inferred) against the one the old queue held
    there. 0 inside the frozen prefix (done < inference_delay); past it, RTC's guidance keeps it
    small. None when the old queue ran out first: there is no seam, the robot stood still."""
    if prev is None or done >= len(prev):
        return None
    return float(abs(actions[done] - prev[done]).max())


def past_prefix(actions: Any, prev: Any, delay: int, positions: int = 4) -> list[float]:
    """max |actions[j] - prev[j]| for j = delay, delay + 1, ...: the seam this chunk would show had its
    frame taken 0, 1, ... actions longer than `inference_delay` (RTC guides there; it freezes before).
    An ordinary chunk's list is what a chunk after a failover, late by as many actions, compares with."""
    if prev is None:
        return []
    return [float(abs(actions[j] - prev[j]).max()) for j in range(delay, min(len(prev), delay + positions))]


def close(policy: Any) -> None:
    """Close a session's socket. openpi-client's WebsocketClientPolicy has no close() and no receive
    timeout; closing its socket ends a blocked infer() with ConnectionClosed."""
    try:
        policy._ws.close()
    except Exception:  # already closed by the server
        pass


class Robot:
    """One robot: a queue executed at `hz`, frames sent from a thread, the session reopened on failure."""

    def __init__(self, index: int, url: str, key: str | None, hz: float, threshold: float, late: str = "drop",
                 reconnect_s: float = 10.0, frame_timeout_s: float = 5.0) -> None:
        import numpy as np

        self.index, self.url, self.key, self.hz, self.threshold, self.late = index, url, key, hz, threshold, late
        self.reconnect_s, self.frame_timeout_s = reconnect_s, frame_timeout_s
        self.rng, self.queue, self.lock, self.stop = np.random.default_rng(index), deque(), threading.Lock(), \
            threading.Event()
        self.latency = 1.0 / hz  # an estimate of the round trip, refined by every reply
        self.sent_at: float | None = None  # when the frame in flight left (the frame timeout's clock)
        self.outage: dict | None = None  # while the session is lost: since when, attempts, the error
        self.report: dict = {"robot": index, "sent": 0, "on_time": 0, "idle_ticks": 0, "ticks": 0,
                             "latency_ms": [], "prefix_exact": True, "errors": [], "stale_discarded": 0,
                             "reconnects": 0, "failovers": [], "seams": [], "past_prefix": [], "chunks": [],
                             "gave_up": None}
        self.policy = self._open(time.monotonic() + reconnect_s)
        meta = self.policy.get_server_metadata()
        self.horizon, self.state_dim = meta["action_horizon"], meta["state_dim"]

    def _open(self, deadline: float) -> Any:
        """A new session at the URL, tried every RETRY_S until `deadline`; NoSessionError after that."""
        from openpi_client.websocket_client_policy import WebsocketClientPolicy

        attempts, last = 0, None
        while not self.stop.is_set():
            attempts += 1
            try:
                return WebsocketClientPolicy(host=self.url, api_key=self.key)
            except Exception as exc:  # refused, closed at the handshake, or no server yet
                last = exc
            if time.monotonic() + RETRY_S > deadline:
                break
            time.sleep(RETRY_S)
        raise NoSessionError(f"robot {self.index}: no session at {self.url} after {attempts} attempt(s) within "
                             f"{self.reconnect_s}s; last error: {last!r}; check the server (/v1/replicas lists "
                             "every group's state) or raise --reconnect-s")

    def _frame(self, step: int) -> tuple[dict, Any, int]:
        """The next observation, with the queue as it is now as prev_actions; (frame, prev, ticks so far)."""
        import numpy as np

        with self.lock:
            prev = np.array(list(self.queue), dtype=np.float32) if self.queue else None
            executed_before = self.report["ticks"]
        frame = {"state": self.rng.standard_normal(self.state_dim).astype(np.float32), "step": step}
        if prev is not None:
            # after a reconnect one action more: a new session's first frame (maybe forwarded) takes longer
            delay = min(len(prev), math.ceil(self.latency * self.hz) + (self.outage is not None))
            frame.update(prev_actions=prev, inference_delay=delay, deadline_ms=max(len(prev) / self.hz * 1e3, 1.0),
                         late=self.late)
        return frame, prev, executed_before

    def request(self, step: int) -> None:
        """Send one frame and take its chunk; on a lost session, reopen it and send the frame again."""
        try:
            while not self.stop.is_set():
                frame, prev, before = self._frame(step)
                self.sent_at = began = time.monotonic()
                try:
                    reply = self.policy.infer(frame)
                except Exception as exc:
                    if not session_lost(exc):  # e.g. deadline_missed: the robot keeps its queue
                        self.report["errors"].append(str(exc)[:200])
                        return
                    self._reconnect(exc)
                    continue
                finally:
                    self.sent_at = None
                self._take(reply, frame, prev, before, time.monotonic() - began)
                return
        except NoSessionError as exc:
            if not self.stop.is_set():  # not the robot's own end cutting its attempts short
                self.report["gave_up"] = str(exc)

    def _reconnect(self, exc: BaseException) -> None:
        """The session is lost: note the outage (once) and open a new one before its deadline."""
        if self.outage is None:
            self.outage = {"failed_at": time.time(), "began": time.monotonic(), "attempts": 0,
                           "error": str(exc)[:200]}
        self.outage["attempts"] += 1
        close(self.policy)
        self.policy = self._open(self.outage["began"] + self.reconnect_s)
        self.report["reconnects"] += 1

    def _take(self, reply: dict, frame: dict, prev: Any, before: int, took: float) -> None:
        import numpy as np

        self.latency = 0.8 * self.latency + 0.2 * took
        if stale(reply):  # never execute a chunk that came after its deadline
            self.report["stale_discarded"] += 1
            return
        actions, report, timing = reply["actions"], self.report, reply.get("server_timing") or {}
        with self.lock:
            done = report["ticks"] - before  # executed while the frame was inferred
            if prev is not None:
                d = frame["inference_delay"]
                report["prefix_exact"] &= bool(np.array_equal(actions[:d], prev[:d]))
                report["on_time"] += took * 1e3 <= len(prev) / self.hz * 1e3
            else:
                report["on_time"] += 1
            joint = seam(actions, prev, done)
            late_by = done - frame["inference_delay"] if prev is not None else None
            self.queue.clear()
            self.queue.extend(actions[min(done, self.horizon):])
        report["sent"] += 1
        report["latency_ms"].append(took * 1e3)
        report["chunks"].append([time.time(), timing.get("group"), bool(timing.get("forwarded"))])
        if self.outage is not None:  # the first chunk after a failover
            outage, self.outage = self.outage, None
            report["failovers"].append({"failed_at": outage["failed_at"], "resumed_at": time.time(),
                                        "attempts": outage["attempts"], "seam": joint, "late_by": late_by,
                                        "error": outage["error"]})
        else:
            report["seams"].append(joint)
            if prev is not None:
                report["past_prefix"].append(past_prefix(actions, prev, frame["inference_delay"]))

    def run(self, seconds: float) -> dict:
        """Act for `seconds` (after the first chunk); the report."""
        self.request(0)  # the first chunk, before the robot moves
        step, thread, tick_at = 1, None, time.monotonic()
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.report["gave_up"]:
            time.sleep(max(tick_at - time.monotonic(), 0))
            tick_at += 1 / self.hz
            with self.lock:
                self.report["ticks"] += 1
                if self.queue:
                    self.queue.popleft()  # execute one action
                else:
                    self.report["idle_ticks"] += 1
                low = len(self.queue) <= self.threshold * self.horizon
            self._watch()
            if low and (thread is None or not thread.is_alive()):
                thread = threading.Thread(target=self.request, args=(step,), daemon=True)
                thread.start()
                step += 1
        self.stop.set()
        if thread is not None:
            thread.join(timeout=self.frame_timeout_s + 1)
        close(self.policy)
        return self._summary(time.time())

    def _watch(self) -> None:
        """A frame unanswered for frame_timeout_s: close the socket, so the request thread reconnects."""
        sent = self.sent_at
        if sent is not None and time.monotonic() - sent > self.frame_timeout_s:
            self.sent_at = None
            close(self.policy)

    def _summary(self, ended: float) -> dict:
        report = self.report
        lat = sorted(report.pop("latency_ms"))
        report["latency_p50_ms"] = lat[len(lat) // 2] if lat else None
        report["latency_p99_ms"] = lat[min(int(0.99 * len(lat)), len(lat) - 1)] if lat else None
        times = [t for t, *_ in report["chunks"]] + [ended]  # from the first chunk to the end
        report["max_gap_s"] = max((b - a for a, b in zip(times, times[1:])), default=None)
        seams = [s for s in report["seams"] if s is not None]
        report["seam_max"] = max(seams) if seams else None
        report["dry_chunks"] = report["seams"].count(None) + sum(f["seam"] is None for f in report["failovers"])
        return report


def robot(index: int, url: str, key: str | None, hz: float, seconds: float, threshold: float,
          late: str = "drop", reconnect_s: float = 10.0, frame_timeout_s: float = 5.0) -> dict:
    """Run one robot for `seconds`; its report."""
    try:
        return Robot(index, url, key, hz, threshold, late, reconnect_s, frame_timeout_s).run(seconds)
    except NoSessionError as exc:  # not even the first session opened
        return {"robot": index, "gave_up": str(exc)}


def print_fleet(reports: list[dict]) -> None:
    for r in reports:
        if r.get("sent") is None:
            print(f"robot {r['robot']}: {r['gave_up']}")
            continue
        seams = f"{r['seam_max']:.3f}" if r["seam_max"] is not None else "-"
        print(f"robot {r['robot']}: {r['sent']} frames, {r['on_time']} on time, idle {r['idle_ticks']}/{r['ticks']} "
              f"ticks, latency p50 {r['latency_p50_ms'] or float('nan'):.1f} ms p99 {r['latency_p99_ms'] or float('nan'):.1f}"
              f" ms, frozen prefix exact: {r['prefix_exact']}, seam max {seams}, reconnects {r['reconnects']}, "
              f"longest gap {r['max_gap_s'] or float('nan'):.2f} s, errors: {len(r['errors'])}")
        for f in r["failovers"]:
            print(f"  failover: chunk again after {f['resumed_at'] - f['failed_at']:.2f} s, {f['attempts']} "
                  f"attempt(s), seam {f['seam']}; {f['error'][:100]}")
        if r["gave_up"]:
            print(f"  gave up: {r['gave_up']}")
    ran = [r for r in reports if r.get("sent") is not None]
    sent, on_time = sum(r["sent"] for r in ran), sum(r["on_time"] for r in ran)
    idle, ticks = sum(r["idle_ticks"] for r in ran), sum(r["ticks"] for r in ran)
    print(json.dumps({"robots": len(reports), "frames": sent, "on_time_fraction": on_time / max(sent, 1),
                      "idle_fraction": idle / max(ticks, 1), "prefix_exact": all(r["prefix_exact"] for r in ran),
                      "errors": sum(len(r["errors"]) for r in ran),
                      "stale_discarded": sum(r["stale_discarded"] for r in ran),
                      "reconnects": sum(r["reconnects"] for r in ran),
                      "gave_up": sum(bool(r["gave_up"]) for r in reports)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/openpi")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--robots", type=int, default=8)
    parser.add_argument("--hz", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threshold", type=float, default=0.5, help="send the next frame when the queue holds "
                        "this fraction of a chunk or less (LeRobot's chunk_size_threshold)")
    parser.add_argument("--late", choices=("drop", "finish"), default="drop", help="what the server does with a "
                        "chunk ready after its deadline: drop it (answer deadline_missed) or send it (the robot "
                        "then discards it itself)")
    parser.add_argument("--reconnect-s", type=float, default=10.0, help="how long a robot tries to open a new "
                        "session after its group failed before it gives up")
    parser.add_argument("--frame-timeout-s", type=float, default=5.0, help="a frame unanswered this long counts "
                        "as a lost session")
    parser.add_argument("--report-file", default=None, help="write every robot's whole report here (JSON)")
    parser.add_argument("--robot", type=int, help=argparse.SUPPRESS)  # one robot, in its own process
    opts = parser.parse_args()
    if opts.robot is not None:
        print(json.dumps(robot(opts.robot, opts.url, opts.api_key, opts.hz, opts.seconds, opts.threshold, opts.late,
                               opts.reconnect_s, opts.frame_timeout_s)), flush=True)
        return
    argv = [sys.executable, __file__, "--url", opts.url, "--hz", str(opts.hz), "--seconds", str(opts.seconds),
            "--threshold", str(opts.threshold), "--late", opts.late, "--reconnect-s", str(opts.reconnect_s),
            "--frame-timeout-s", str(opts.frame_timeout_s), *(["--api-key", opts.api_key] if opts.api_key else [])]
    procs = [subprocess.Popen([*argv, "--robot", str(i)], stdout=subprocess.PIPE, text=True) for i in range(opts.robots)]
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=opts.seconds + opts.reconnect_s + 120)
        if proc.returncode != 0 or not out.strip():
            raise SystemExit(f"a robot process exited {proc.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    if opts.report_file:
        with open(opts.report_file, "w") as f:
            json.dump(reports, f)
    print_fleet(reports)
    if any(r["gave_up"] for r in reports):
        raise SystemExit("a robot found no group to act with (see 'gave up' above)")


if __name__ == "__main__":
    main()
