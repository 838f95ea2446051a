"""HTTP serving: the Ray Serve application in which every Serve replica is one replica group.

    serve run phyai_ray.serve:build_app plugin=reference_dit dense_tp_size=2 replicas=2 device=cpu
    phyai-ray serve reference_dit --dense-tp-size 2 --replicas 2 --device cpu
    await group_handle("phyai").step.remote(request)       # from a task, an actor or another app

Two rooms: `runtime/` is where the application runs (the builder, the deployments, the group's
runner, registry, router and server) and `protocols/` is what it speaks (HTTP JSON, OpenAI, the
Open Inference Protocol, openpi). `grpc_v2/` holds the generated gRPC messages.

`import phyai_ray.serve` loads neither Ray nor FastAPI; `build_app`, `create_app`, `group_handle`,
`run_server` and `ServeOptions` load on first use.
"""

from __future__ import annotations

from phyai_ray._lazy import by_module, lazy_exports

_EXPORTS = by_module({
    "phyai_ray.serve.runtime.app": ("build_app", "create_app", "group_handle"),
    "phyai_ray.serve.runtime.server": ("run_server", "Server"),
    "phyai_ray.serve.runtime.options": ("ServeOptions",),
    "phyai_ray.serve.protocols.schema": ("EncodedTensor",),
})

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('phyai_ray.serve', _EXPORTS, globals())
