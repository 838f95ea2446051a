"""Runs in the clients' venv (tests/client_venv.py): robots sending openpi-client frames to a Cosmos3 policy.

    python cosmos3_openpi_robots.py URL KEY FRAMES.npz STEPS

FRAMES.npz holds per robot r: image_r (uint8, HWC or CHW as the robot's camera gives it) and prompt_r.
Each robot (a thread) connects, reads the metadata frame, waits for the others, then sends STEPS
frames {"observation/image", "prompt", "seed": 10 r + step}; after its first, one frame without
the camera. Prints one JSON line: per robot the metadata, the actions and batch size of every reply,
the error frame of the frame without a camera, and the error that ended it, if any.
"""

import json
import sys
import threading

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def drive(robot: int, url: str, key: str, frames: dict, steps: int, out: dict, ready: threading.Barrier) -> None:
    record = out[robot] = {"actions": [], "seeds": [], "batch_sizes": [], "refused": None, "error": None}
    policy = WebsocketClientPolicy(host=url, api_key=key)
    record["metadata"] = policy.get_server_metadata()
    ready.wait(timeout=120)
    prompt = str(frames[f"prompt_{robot}"])
    for step in range(steps):
        seed = 10 * robot + step
        try:
            reply = policy.infer({"observation/image": frames[f"image_{robot}"], "prompt": prompt, "seed": seed})
            if step == 0:
                try:
                    policy.infer({"prompt": prompt})
                except RuntimeError as exc:  # the server's error frame; the session goes on
                    record["refused"] = str(exc)
        except Exception as exc:  # RuntimeError: an error frame; ConnectionClosed: the session ended
            record["error"] = f"{type(exc).__name__}: {exc}"
            break
        record["actions"].append(np.asarray(reply["actions"]).tolist())
        record["seeds"].append(seed)
        record["batch_sizes"].append(reply["server_timing"]["batch_size"])


def main() -> None:
    url, key, path, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    frames = dict(np.load(path))
    robots = len([k for k in frames if k.startswith("image_")])
    out: dict = {}
    ready = threading.Barrier(robots)
    threads = [threading.Thread(target=drive, args=(r, url, key, frames, steps, out, ready)) for r in range(robots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
