"""Plugin declaration (`Entry`), lookup (`resolve_plugin`) and per-rank context."""

from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.registry import register_plugin, registered_names, resolve_plugin

__all__ = ["Entry", "register_plugin", "registered_names", "resolve_plugin"]
