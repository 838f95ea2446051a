"""LeRobot policies (SmolVLA, pi0, pi0.5) served one action-expert Euler step per iteration across
robots, equal to LeRobot 0.4.4's chunks: see `entry.py` for usage."""

from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry

__all__ = ["LeRobotPolicyEntry"]
