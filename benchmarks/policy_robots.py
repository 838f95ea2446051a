"""The openpi-client robots of benchmarks/bench_policy.py; runs in the clients' venv (tests/client_venv.py).

    python policy_robots.py WS_URL FRAMES_NPZ ROBOTS HZ SECONDS DEADLINE_MS LONE

First one robot sends LONE frames back to back (after 3 to warm up): its round trips and the server's
infer_ms. Then ROBOTS robots, phases spread over one period, send a frame every 1 / HZ s for SECONDS
with a DEADLINE_MS deadline each. Prints one JSON line: {"lone": [[rtt_ms, infer_ms], ...], "robots":
{r: {"rtt", "sizes", "errors", "sent", "on_time"}}}.
"""

import json
import sys
import threading
import time

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def obs(frames: dict, r: int, step: int) -> dict:
    return {"observation/image": frames[f"image_{r}"], "observation/wrist_image": frames[f"wrist_image_{r}"],
            "observation/state": frames[f"state_{r}"], "prompt": str(frames[f"prompt_{r}"]), "step": step}


def one(policy: WebsocketClientPolicy, o: dict) -> tuple:
    """(round trip ms, server_timing), or (None, the error frame's text)."""
    began = time.perf_counter()
    try:
        reply = policy.infer(o)
    except Exception as exc:
        return None, str(exc)[:200]
    return (time.perf_counter() - began) * 1e3, reply["server_timing"]


def robot(url: str, frames: dict, r: int, rec: dict, start: threading.Barrier, robots: int, hz: float,
          seconds: float, deadline_ms: float) -> None:
    policy = WebsocketClientPolicy(host=url)
    start.wait(60)
    time.sleep(r / (robots * hz))  # robots' phases spread over one period
    next_at, until = time.monotonic(), time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at = max(next_at + 1 / hz, time.monotonic())
        rtt, timing = one(policy, {**obs(frames, r, rec["sent"]), "deadline_ms": deadline_ms})
        rec["sent"] += 1
        if rtt is None:
            rec["errors"].append(timing)
        else:
            rec["rtt"].append(rtt)
            rec["sizes"].append(timing["batch_size"])
            rec["on_time"] += rtt <= deadline_ms


def main() -> None:
    url, path = sys.argv[1], sys.argv[2]
    robots, hz, seconds, deadline_ms, lone = int(sys.argv[3]), *map(float, sys.argv[4:7]), int(sys.argv[7])
    frames = dict(np.load(path))
    out = {"lone": [], "robots": {}}
    policy = WebsocketClientPolicy(host=url)
    for step in range(lone + 3):  # one robot, frames back to back, the first 3 to warm up
        rtt, timing = one(policy, obs(frames, 0, step))
        if step >= 3 and rtt is not None:
            out["lone"].append([rtt, timing["infer_ms"]])
    start = threading.Barrier(robots)
    recs = {r: {"rtt": [], "sizes": [], "errors": [], "sent": 0, "on_time": 0} for r in range(robots)}
    out["robots"] = recs
    threads = [threading.Thread(target=robot, args=(url, frames, r, recs[r], start, robots, hz, seconds, deadline_ms))
               for r in range(robots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
