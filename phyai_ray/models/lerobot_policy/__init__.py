"""LeRobot policies (SmolVLA; pi0 / pi0.5 folders read and refused until their model code lands),
served one action-expert Euler step per iteration across robots: see `entry.py` for usage."""

from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry

__all__ = ["LeRobotPolicyEntry"]
