"""phyai-ray: serve PyTorch models on Ray behind one `Engine` interface.

    from phyai_ray import Engine, EngineArgs
    with Engine(EngineArgs(plugin="reference_dit")) as engine:
        out = engine.step({"tokens": ...})

`import phyai_ray` starts nothing and imports neither Ray nor torch; names load on first use.
"""

from __future__ import annotations

from phyai_ray._lazy import by_module, lazy_exports

__version__ = "0.1.0"

_EXPORTS = by_module({
    "phyai_ray.engine": ("Engine",),
    "phyai_ray.config.engine": ("EngineArgs", "EngineConfig", "DeviceConfig"),
    "phyai_ray.config.parallel": ("ParallelConfig", "OuterParallelConfig", "DenseParallelConfig",
                                  "AttentionParallelConfig", "MoeParallelConfig"),
    "phyai_ray.config.deployment": ("DeploymentConfig", "WorkerSupervisorConfig", "PlacementSpec"),
    "phyai_ray.config.batching": ("BatchingConfig",),
    "phyai_ray.plugins.entry": ("Entry",),
    "phyai_ray.plugins.registry": ("register_plugin",),
    "phyai_ray.collectives": ("P",),
    "phyai_ray.plugins.context": ("RankContext",),
    "phyai_ray.errors": ("PhyAIError", "ParallelConfigError", "DeploymentConfigError", "PluginError", "StartupError",
                         "EngineUnavailableError", "EngineOverloadedError", "RequestTimeoutError",
                         "DeadlineMissedError", "RequestAbortedError", "ReplicaStateError",
                         "WeightUpdateRefusedError", "RequestRejectedError", "StreamNotSupportedError"),
    "phyai_ray.executors.control": ("ReplicaState", "ControlReport"),
    "phyai_ray.rl.actor": ("EngineActor", "StepResult"),
    "phyai_ray.rl.sender": ("WeightSender",),
    "phyai_ray.outputs": ("TokenOutput",),
})

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('phyai_ray', _EXPORTS, globals())
