"""Runs in the clients' venv (tests/client_venv.py): robots with real-time chunking on `openpi_client`.

    python flow_robots.py URL KEY ROBOTS STEPS

Each robot (a thread) connects to URL (its query may carry deadline_ms), reads the metadata frame,
and sends STEPS frames {"state", "step"}; from the second on, with RTC fields: the previous chunk's
actions after its first EXECUTED as prev_actions, inference_delay DELAY. Then three more frames:
one with a deadline it cannot meet (deadline_ms in the observation), one with a bad RTC field, and
a plain one: the session must survive the first two. Prints one JSON line: per robot each reply's
server_timing, whether the frozen prefix came back exactly, and the three probes' outcomes.
"""

import json
import sys
import threading

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy

EXECUTED, DELAY = 8, 2


def observation(robot: int, step: int, state_dim: int) -> dict:
    rng = np.random.default_rng(1000 * robot + step)
    return {"state": rng.standard_normal(state_dim).astype(np.float32), "step": step}


def probe(policy, obs) -> str:
    try:
        reply = policy.infer(obs)
    except Exception as exc:
        return f"error: {exc}"
    return "ok" if reply["actions"].shape[0] > 0 else "empty"


def drive(robot: int, url: str, key: str, steps: int, out: dict, start: threading.Barrier) -> None:
    record = out[robot] = {"timing": [], "prefix_exact": [], "error": None}
    try:
        policy = WebsocketClientPolicy(host=url, api_key=key)
        meta = policy.get_server_metadata()
        record["metadata"] = meta
        start.wait(timeout=120)
        prev = None
        for step in range(steps):
            obs = observation(robot, step, meta["state_dim"])
            if prev is not None:
                obs.update(prev_actions=prev, inference_delay=DELAY)
            reply = policy.infer(obs)
            actions = reply["actions"]
            if prev is not None:
                record["prefix_exact"].append(bool(np.array_equal(actions[:DELAY], prev[:DELAY])))
            record["timing"].append(reply["server_timing"])
            prev = actions[EXECUTED:].astype(np.float32)
        state = observation(robot, steps, meta["state_dim"])
        record["late"] = probe(policy, {**state, "deadline_ms": 0.001})
        record["bad_rtc"] = probe(policy, {**state, "prev_actions": prev, "inference_delay": prev.shape[0] + 1})
        record["after"] = probe(policy, state)
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"


def main() -> None:
    url, key, robots, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    out: dict = {}
    start = threading.Barrier(robots)
    threads = [threading.Thread(target=drive, args=(r, url, key, steps, out, start)) for r in range(robots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
