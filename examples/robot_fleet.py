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
Each robot reports: frames sent, on time (back before its queue ran dry), idle ticks (the queue was
empty: the robot stood still), the latency p50 / p99, and whether the frozen prefix came back as
sent. The parent prints one line per robot and the fleet's totals.
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


def stale(reply: dict) -> bool:
    """Whether a reply's chunk must not be executed: its `server_timing` says the deadline was missed."""
    timing = reply.get("server_timing") or {}
    return timing.get("deadline_met") is False


def robot(index: int, url: str, key: str | None, hz: float, seconds: float, threshold: float,
          late: str = "drop") -> dict:
    import numpy as np
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    policy = WebsocketClientPolicy(host=url, api_key=key)
    meta = policy.get_server_metadata()
    horizon, state_dim = meta["action_horizon"], meta["state_dim"]
    rng = np.random.default_rng(index)
    queue: deque = deque()
    lock = threading.Lock()
    report = {"robot": index, "sent": 0, "on_time": 0, "idle_ticks": 0, "ticks": 0, "latency_ms": [],
              "prefix_exact": True, "errors": [], "stale_discarded": 0}
    pending: dict = {}
    latency = 1.0 / hz  # an estimate of the round trip, refined by every reply

    def request(step: int) -> None:
        nonlocal latency
        with lock:
            prev = np.array(list(queue), dtype=np.float32) if queue else None
            executed_before = report["ticks"]
        frame = {"state": rng.standard_normal(state_dim).astype(np.float32), "step": step}
        dry_ms = (len(prev) if prev is not None else 0) / hz * 1e3
        if prev is not None:
            delay = min(len(prev), math.ceil(latency * hz))
            frame.update(prev_actions=prev, inference_delay=delay, deadline_ms=max(dry_ms, 1.0), late=late)
        began = time.perf_counter()
        try:
            reply = policy.infer(frame)
        except Exception as exc:  # an error frame (e.g. deadline_missed): the robot keeps its queue
            report["errors"].append(str(exc)[:200])
            pending.clear()
            return
        took = time.perf_counter() - began
        latency = 0.8 * latency + 0.2 * took
        if stale(reply):  # never execute a chunk that came after its deadline
            report["stale_discarded"] += 1
            pending.clear()
            return
        actions = reply["actions"]
        with lock:
            done = report["ticks"] - executed_before  # executed while the frame was inferred
            if prev is not None:
                d = frame["inference_delay"]
                report["prefix_exact"] &= bool(np.array_equal(actions[:d], prev[:d]))
                report["on_time"] += took * 1e3 <= dry_ms
            else:
                report["on_time"] += 1
            report["sent"] += 1
            report["latency_ms"].append(took * 1e3)
            queue.clear()
            queue.extend(actions[min(done, horizon):])
        pending.clear()

    request(0)  # the first chunk, before the robot moves
    step, tick_at, end = 1, time.monotonic(), time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(max(tick_at - time.monotonic(), 0))
        tick_at += 1 / hz
        with lock:
            report["ticks"] += 1
            if queue:
                queue.popleft()  # execute one action
            else:
                report["idle_ticks"] += 1
            low = len(queue) <= threshold * horizon
        if low and not pending:
            pending["thread"] = threading.Thread(target=request, args=(step,), daemon=True)
            pending["thread"].start()
            step += 1
    thread = pending.get("thread")
    if thread is not None:
        thread.join(timeout=10)
    lat = sorted(report.pop("latency_ms"))
    report["latency_p50_ms"] = lat[len(lat) // 2] if lat else None
    report["latency_p99_ms"] = lat[min(int(0.99 * len(lat)), len(lat) - 1)] if lat else None
    return report


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
    parser.add_argument("--robot", type=int, help=argparse.SUPPRESS)  # one robot, in its own process
    opts = parser.parse_args()
    if opts.robot is not None:
        print(json.dumps(robot(opts.robot, opts.url, opts.api_key, opts.hz, opts.seconds, opts.threshold, opts.late)),
              flush=True)
        return
    argv = [sys.executable, __file__, "--url", opts.url, "--hz", str(opts.hz), "--seconds", str(opts.seconds),
            "--threshold", str(opts.threshold), "--late", opts.late,
            *(["--api-key", opts.api_key] if opts.api_key else [])]
    procs = [subprocess.Popen([*argv, "--robot", str(i)], stdout=subprocess.PIPE, text=True) for i in range(opts.robots)]
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=opts.seconds + 120)
        if proc.returncode != 0 or not out.strip():
            raise SystemExit(f"a robot process exited {proc.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for r in reports:
        print(f"robot {r['robot']}: {r['sent']} frames, {r['on_time']} on time, idle {r['idle_ticks']}/{r['ticks']} "
              f"ticks, latency p50 {r['latency_p50_ms'] or float('nan'):.1f} ms p99 {r['latency_p99_ms'] or float('nan'):.1f}"
              f" ms, frozen prefix exact: {r['prefix_exact']}, errors: {len(r['errors'])}")
    sent, on_time = sum(r["sent"] for r in reports), sum(r["on_time"] for r in reports)
    idle, ticks = sum(r["idle_ticks"] for r in reports), sum(r["ticks"] for r in reports)
    print(json.dumps({"robots": len(reports), "frames": sent, "on_time_fraction": on_time / max(sent, 1),
                      "idle_fraction": idle / max(ticks, 1), "prefix_exact": all(r["prefix_exact"] for r in reports),
                      "errors": sum(len(r["errors"]) for r in reports),
                      "stale_discarded": sum(r["stale_discarded"] for r in reports)}))


if __name__ == "__main__":
    main()
