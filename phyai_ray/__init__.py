"""phyai-ray: serve PyTorch models on Ray behind one `Engine` interface.

    from phyai_ray import Engine, EngineArgs
    with Engine(EngineArgs(plugin="reference_dit")) as engine:
        out = engine.step({"tokens": ...})

`import phyai_ray` starts nothing and imports neither Ray nor torch; names load on first use.
"""

from __future__ import annotations

from phyai_ray._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "phyai_ray.engine",
    "EngineArgs": "phyai_ray.config.engine",
    "EngineConfig": "phyai_ray.config.engine",
    "DeviceConfig": "phyai_ray.config.engine",
    "ParallelConfig": "phyai_ray.config.parallel",
    "OuterParallelConfig": "phyai_ray.config.parallel",
    "DenseParallelConfig": "phyai_ray.config.parallel",
    "AttentionParallelConfig": "phyai_ray.config.parallel",
    "MoeParallelConfig": "phyai_ray.config.parallel",
    "DeploymentConfig": "phyai_ray.config.deployment",
    "WorkerSupervisorConfig": "phyai_ray.config.deployment",
    "PlacementSpec": "phyai_ray.config.deployment",
    "BatchingConfig": "phyai_ray.config.batching",
    "Entry": "phyai_ray.plugins.entry",
    "register_plugin": "phyai_ray.plugins.registry",
    "P": "phyai_ray.collectives",
    "RankContext": "phyai_ray.plugins.context",
    "PhyAIError": "phyai_ray.errors",
    "ParallelConfigError": "phyai_ray.errors",
    "DeploymentConfigError": "phyai_ray.errors",
    "PluginError": "phyai_ray.errors",
    "StartupError": "phyai_ray.errors",
    "EngineUnavailableError": "phyai_ray.errors",
    "EngineOverloadedError": "phyai_ray.errors",
    "RequestTimeoutError": "phyai_ray.errors",
    "DeadlineMissedError": "phyai_ray.errors",
    "RequestAbortedError": "phyai_ray.errors",
    "ReplicaStateError": "phyai_ray.errors",
    "WeightUpdateRefusedError": "phyai_ray.errors",
    "ReplicaState": "phyai_ray.executors.control",
    "ControlReport": "phyai_ray.executors.control",
    "EngineActor": "phyai_ray.rl.actor",
    "StepResult": "phyai_ray.rl.actor",
    "WeightSender": "phyai_ray.rl.sender",
    "TokenOutput": "phyai_ray.outputs",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('phyai_ray', _EXPORTS, globals())
