"""One robot of fleet_policy.py's failover part; runs in the clients' venv (tests/client_venv.py).

    .venv-clients/bin/python benchmarks/policy_failover_robots.py WS_URL INDEX HZ SECONDS

examples/robot_fleet.py's Robot (its queue, real-time chunking fields, reconnects and seams) sending a
pi0-shaped `lerobot_policy`'s observation under openpi's keys: `observation/state` (the state it
would send), two uint8 HWC 96 x 96 cameras (`observation/image`, `observation/wrist_image`) and a
prompt. Prints the robot's report as one JSON line (robot_fleet.py's `Robot.run`).
"""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

SPEC = importlib.util.spec_from_file_location("robot_fleet",
                                              Path(__file__).resolve().parents[1] / "examples" / "robot_fleet.py")
fleet = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(fleet)


class PolicyRobot(fleet.Robot):
    """A robot whose frames carry cameras and a prompt beside the state: {"observation/state": ..., ...}."""

    def _frame(self, step: int) -> tuple:
        frame, prev, before = super()._frame(step)
        frame["observation/state"] = frame.pop("state")
        frame.update({"observation/image": self.rng.integers(0, 256, (96, 96, 3), dtype=np.uint8),
                      "observation/wrist_image": self.rng.integers(0, 256, (96, 96, 3), dtype=np.uint8),
                      "prompt": f"pick up cube {self.index}"})
        return frame, prev, before


def main() -> None:
    url, index, hz, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    try:
        report = PolicyRobot(index, url, None, hz, 0.5, late="finish").run(seconds)
    except fleet.NoSessionError as exc:  # not even the first session opened
        report = {"robot": index, "gave_up": str(exc)}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
