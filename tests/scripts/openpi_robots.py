"""Runs in the clients' venv (tests/client_venv.py): robots driving `openpi_client.WebsocketClientPolicy`.

    python openpi_robots.py URL KEY ROBOTS STEPS PAUSE_S

Each robot (a thread) connects, reads the metadata frame, then sends STEPS observations
{"state": seeded float32 [state_dim], "step": i}. Prints "started" once every robot has acted,
then one JSON line: per robot the metadata, the actions of every step, the groups and request
ids of the replies, and the error (text frame or closed connection) that ended it, if any.
"""

import json
import sys
import threading
import time

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def observation(robot: int, step: int, state_dim: int) -> dict:
    rng = np.random.default_rng(1000 * robot + step)
    return {"state": rng.standard_normal(state_dim).astype(np.float32), "step": step}


def drive(robot: int, url: str, key: str, steps: int, pause_s: float, out: dict, acted: threading.Barrier) -> None:
    record = out[robot] = {"states": [], "actions": [], "groups": [], "ids": [], "timing_keys": [], "error": None,
                           "error_at": None}
    policy = WebsocketClientPolicy(host=url, api_key=key)
    record["metadata"] = meta = policy.get_server_metadata()
    for step in range(steps):
        obs = observation(robot, step, meta["state_dim"])
        try:
            reply = policy.infer(obs)
        except Exception as exc:  # RuntimeError: the server's error frame; ConnectionClosed: it ended the session
            record["error"], record["error_at"] = f"{type(exc).__name__}: {exc}", time.time()
            break
        finally:
            if step == 0:
                acted.wait(timeout=120)
        record["states"].append(obs["state"].tolist())
        record["actions"].append(reply["actions"].tolist())
        timing = reply["server_timing"]
        record["groups"].append(timing["group"])
        record["ids"].append(timing["request_id"])
        record["timing_keys"] = sorted(timing)
        time.sleep(pause_s)


def main() -> None:
    url, key, robots, steps, pause_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    out: dict = {}
    acted = threading.Barrier(robots + 1)
    threads = [threading.Thread(target=drive, args=(r, url, key, steps, pause_s, out, acted)) for r in range(robots)]
    for t in threads:
        t.start()
    acted.wait(timeout=120)
    print("started", flush=True)
    for t in threads:
        t.join(timeout=600)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
