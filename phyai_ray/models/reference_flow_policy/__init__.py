"""The example flow-matching robot policy plugin (`reference_flow_policy`); see `entry.py` for usage."""

from phyai_ray.models.reference_flow_policy.config import FlowPolicyConfig
from phyai_ray.models.reference_flow_policy.entry import ReferenceFlowPolicyEntry
from phyai_ray.models.reference_flow_policy.model import ReferenceFlowPolicy

__all__ = ["FlowPolicyConfig", "ReferenceFlowPolicy", "ReferenceFlowPolicyEntry"]
