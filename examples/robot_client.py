"""A robot driving the example policy over openpi's WebSocket protocol, with `openpi-client`.

    pip install openpi-client             # its own venv if it pins numpy < 2 against yours
    phyai-ray serve reference_policy --dense-tp-size 2 --replicas 2 --device cpu --cpus-per-rank 0.5 --api-key KEY
    python examples/robot_client.py --url ws://127.0.0.1:8000/v1/openpi --api-key KEY --steps 200

It reads the server's metadata frame (state and action sizes), then sends one observation per
step and executes the first action of each chunk it gets back. It prints the group that answered
(one connection = one group), the round-trip p50/p99 and the server's own time. It needs only
openpi-client and NumPy, not phyai-ray.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/openpi")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    policy = WebsocketClientPolicy(host=args.url, api_key=args.api_key)
    meta = policy.get_server_metadata()
    print(f"server metadata: {meta}")
    rng = np.random.default_rng(args.seed)
    state = rng.standard_normal(meta["state_dim"]).astype(np.float32)
    rtts, server_ms, groups = [], [], set()
    for step in range(args.steps):
        start = time.perf_counter()
        reply = policy.infer({"state": state, "step": step, "prompt": "pick up the cup"})
        rtts.append((time.perf_counter() - start) * 1e3)
        chunk = reply["actions"]  # [action_horizon, action_dim]
        timing = reply["server_timing"]
        server_ms.append(timing["infer_ms"])
        groups.add(timing["group"])
        state = (state + 0.1 * np.resize(chunk[0], state.shape)).astype(np.float32)  # "execute" the first action
    rtts.sort()
    print(f"{args.steps} steps on group(s) {sorted(groups)}: round trip p50 {statistics.median(rtts):.2f} ms, "
          f"p99 {rtts[int(0.99 * (len(rtts) - 1))]:.2f} ms; server infer p50 {statistics.median(server_ms):.2f} ms")
    print(f"last action chunk {chunk.shape}, first action {np.round(chunk[0], 3).tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
