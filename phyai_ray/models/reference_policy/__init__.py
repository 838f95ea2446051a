"""The example robot policy plugin (`reference_policy`); see `entry.py` for usage."""

from phyai_ray.models.reference_policy.entry import ReferencePolicyEntry
from phyai_ray.models.reference_policy.model import PolicyConfig, ReferencePolicy

__all__ = ["PolicyConfig", "ReferencePolicy", "ReferencePolicyEntry"]
