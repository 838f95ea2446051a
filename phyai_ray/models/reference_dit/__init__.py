"""The reference parallel transformer plugin (`reference_dit`); see `entry.py` for usage.

    config.py   plugin_args and the topology checks
    request.py  request shape, JSON model and request-time layout checks
    model.py    pipeline stages, guidance branches, `step`

Its shape, seeded weights and sharded layers are the layers room's (`phyai_ray.nn`), shared with
`reference_lm` and the robot policies.
"""

from phyai_ray.models.reference_dit.config import ReferenceDiTConfig
from phyai_ray.models.reference_dit.entry import ReferenceDiTEntry
from phyai_ray.models.reference_dit.model import ReferenceDiT
from phyai_ray.models.reference_dit.request import ReferenceDiTRequest

__all__ = ["ReferenceDiT", "ReferenceDiTConfig", "ReferenceDiTEntry", "ReferenceDiTRequest"]
