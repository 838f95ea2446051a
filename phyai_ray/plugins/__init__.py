"""Plugin declaration (`Entry`), lookup (`resolve_plugin`) and per-rank context; the contracts the
edges read of a plugin (`tokens`: what the OpenAI routes use of a token plugin)."""

from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.registry import register_plugin, registered_names, resolve_plugin

__all__ = ["Entry", "register_plugin", "registered_names", "resolve_plugin"]
