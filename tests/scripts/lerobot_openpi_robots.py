"""Runs in the clients' venv (tests/client_venv.py): robots sending openpi-client frames to a LeRobot policy.

    python lerobot_openpi_robots.py URL KEY FRAMES.npz STEPS

FRAMES.npz holds per robot r: image_r, wrist_image_r (uint8 HWC), state_r (float32), noise_r and
prompt_r. Each robot (a thread) connects, reads the metadata frame and sends its frame STEPS times
under openpi's keys ("observation/image", "observation/wrist_image", "observation/state",
"prompt"). Prints one JSON line: per robot the metadata, the actions of every reply, the batch
sizes and the error that ended it, if any.
"""

import json
import sys
import threading

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def drive(robot: int, url: str, key: str, frames: dict, steps: int, out: dict) -> None:
    record = out[robot] = {"actions": [], "batch_sizes": [], "error": None}
    policy = WebsocketClientPolicy(host=url, api_key=key)
    record["metadata"] = policy.get_server_metadata()
    obs = {"observation/image": frames[f"image_{robot}"], "observation/wrist_image": frames[f"wrist_image_{robot}"],
           "observation/state": frames[f"state_{robot}"], "prompt": str(frames[f"prompt_{robot}"]),
           "noise": frames[f"noise_{robot}"]}
    for _ in range(steps):
        try:
            reply = policy.infer(obs)
        except Exception as exc:  # RuntimeError: the server's error frame; ConnectionClosed: the session ended
            record["error"] = f"{type(exc).__name__}: {exc}"
            break
        record["actions"].append(np.asarray(reply["actions"]).tolist())
        record["batch_sizes"].append(reply["server_timing"]["batch_size"])


def main() -> None:
    url, key, path, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    frames = dict(np.load(path))
    robots = len([k for k in frames if k.startswith("state_")])
    out: dict = {}
    threads = [threading.Thread(target=drive, args=(r, url, key, frames, steps, out)) for r in range(robots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
