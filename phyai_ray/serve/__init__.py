"""HTTP serving edge: the tensor JSON codec and the Ray Serve application.

    serve run phyai_ray.serve:build_app plugin=reference_dit dense_tp_size=2 replicas=2 device=cpu
    phyai-ray serve reference_dit --dense-tp-size 2 --replicas 2 --device cpu

`import phyai_ray.serve` loads neither Ray nor FastAPI; `build_app`, `create_app`, `run_server`
and `ServeOptions` load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_app": "phyai_ray.serve.app",
    "create_app": "phyai_ray.serve.app",
    "run_server": "phyai_ray.serve.server",
    "Server": "phyai_ray.serve.server",
    "ServeOptions": "phyai_ray.serve.options",
    "EncodedTensor": "phyai_ray.serve.schema",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'phyai_ray.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
