"""Configuration models: validated with no environment, network or Ray."""

from phyai_ray.config.batching import BatchingConfig
from phyai_ray.config.deployment import DeploymentConfig, WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig, EngineArgs, EngineConfig
from phyai_ray.config.parallel import (AttentionParallelConfig, DenseParallelConfig, MoeParallelConfig,
                                       OuterParallelConfig, ParallelConfig)

__all__ = ["AttentionParallelConfig", "BatchingConfig", "DenseParallelConfig", "DeploymentConfig", "DeviceConfig", "EngineArgs",
           "EngineConfig", "MoeParallelConfig", "OuterParallelConfig", "ParallelConfig", "WorkerSupervisorConfig"]
