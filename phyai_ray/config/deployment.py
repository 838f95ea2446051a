"""Where replicas run: inline, local Ray actors, an existing Ray cluster, or torchrun ranks.

| condition                                         | mode     |
|---------------------------------------------------|----------|
| one rank, one replica, no explicit `devices`      | inline   |
| ranks > 1 or replicas > 1, or explicit `devices`  | local    |
| `DeploymentConfig.cluster(address=...)`           | cluster  |
| `DeploymentConfig.external()`                     | external |

`worker_count = replica_count * ranks_per_replica`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from phyai_ray.config.base import ConfigModel
from phyai_ray.config.batching import BatchingConfig
from phyai_ray.errors import DeploymentConfigError

DEFAULT_HANG_LIMIT_S = 600.0  # a rank call running this long, with no limit configured, is a hang
Mode = Literal["auto", "inline", "local", "cluster", "external"]
Strategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


class WorkerSupervisorConfig(ConfigModel):
    """Ports and deadlines of managed (Ray) rank workers."""

    base_port: int | None = Field(
        None, ge=1024, le=65535 - 1024,
        description="First torch.distributed rendezvous port; replica i uses base_port + i. None picks a free port.")
    execution_timeout_s: float | None = Field(
        None, gt=0, description="A request's own cap, when set: unfinished this long after submission (queueing "
        "included) it fails with RequestTimeoutError and the replica keeps serving. Unset: a step request's limit "
        "is the hang limit (below); an iterative request's is its deadline, else its planned iterations x the "
        "recent iteration time, twice, plus the hang limit. Set without rank_call_timeout_s it is the hang limit "
        "too, as before.")
    rank_call_timeout_s: float | None = Field(
        None, gt=0, description="The hang limit: one rank call (a step, a batch, one iteration) RUNNING this long "
        "means a rank is stuck; the replica fails with EngineUnavailableError (reason 'timeout') and its ranks are "
        "killed. Unset: execution_timeout_s when that is set, else 600 s. A long job of short iterations is no hang.")
    max_ongoing_requests: int = Field(
        2, ge=1, le=1024, description="Requests at a replica's ranks at once (the rest wait in the engine-side "
        "queue); 2 keeps the next request ready while one runs. Inline replicas run one at a time.")
    max_queued_requests: int = Field(
        4096, ge=0, le=10_000_000, description="Requests waiting in one replica's engine-side queue; when every "
        "healthy replica's queue is full, submit raises EngineOverloadedError at once.")
    collective_timeout_s: float = Field(
        600.0, gt=0, description="Timeout of every torch.distributed process group of a replica (a collective "
        "that waits longer raises on its ranks, which fails the replica).")
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Deadline for a replica to be placed, form its process groups and load the plugin.")
    rpc_timeout_s: float = Field(
        120.0, gt=0, description="Default deadline of collective_rpc calls.")
    request_transport: Literal["auto", "ipc", "compiled", "actor_calls"] = Field(
        "auto", description="How requests reach a Ray replica's ranks and results come back. 'ipc': one Unix "
        "socket per rank from the engine, large CPU tensors in shared memory (one copy, mapped by every rank); "
        "every rank must be on the engine's node (Linux). 'actor_calls': one Ray actor call per rank and request "
        "(works across nodes; about 10x the overhead per step). 'compiled': a Ray Compiled Graph per replica "
        "(shared-memory channels whose readers poll: each rank and one reader per replica in the engine keep a "
        "CPU core busy while idle). 'auto': 'ipc' when every rank is on the engine's node, else 'actor_calls'.")
    liveness_interval_s: float = Field(
        0.25, gt=0, le=5, description="How often rank liveness is checked; a dead rank is noticed within ~4x this.")
    shutdown_timeout_s: float = Field(
        10.0, gt=0, description="Deadline for stopping workers and removing placement groups on close.")

    @property
    def hang_limit_s(self) -> float:
        """How long one rank call may run before its replica is judged hung (see rank_call_timeout_s)."""
        for limit in (self.rank_call_timeout_s, self.execution_timeout_s):
            if limit is not None:
                return limit
        return DEFAULT_HANG_LIMIT_S

    @property
    def step_limit_s(self) -> float:
        """A step request's limit from submission: execution_timeout_s when set, else the hang limit."""
        return self.execution_timeout_s if self.execution_timeout_s is not None else self.hang_limit_s


class PlacementSpec(ConfigModel):
    """Run one replica's ranks in bundles of a placement group someone else owns.

    `DeploymentConfig(placement=PlacementSpec(pg, bundle_indices=(1, 2)))` puts rank r in bundle
    `bundle_indices[r]` of `pg` instead of reserving a placement group of the replica's own. The
    owner (a Serve replica, an RL trainer) keeps the group: closing the engine kills the ranks and
    leaves the placement group in place. This is how verl's rollout modes map: HYBRID = the
    trainer's own bundles, COLOCATED = other bundles of the same group, STANDALONE = no spec.
    Each bundle must hold one rank's demand (`cpus_per_rank` CPUs, and a GPU on CUDA).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    placement_group: Any = Field(description="A ray.util.placement_group.PlacementGroup (ready or not).")
    bundle_indices: tuple[int, ...] = Field(description="Bundle of each rank, in rank order.")

    def __init__(self, placement_group: Any = None, bundle_indices: Any = None, /, **data: Any) -> None:
        if placement_group is not None:
            data["placement_group"] = placement_group
        if bundle_indices is not None:
            data["bundle_indices"] = bundle_indices
        super().__init__(**data)

    @field_validator("placement_group")
    @classmethod
    def _check_group(cls, pg: Any) -> Any:
        if pg is None or not hasattr(pg, "bundle_specs") or not hasattr(pg, "id"):
            raise DeploymentConfigError(f"placement_group={pg!r} is not a Ray PlacementGroup; pass the object "
                                        "returned by ray.util.placement_group(...)")
        return pg

    @model_validator(mode="after")
    def _check_bundles(self) -> "PlacementSpec":
        count = len(self.placement_group.bundle_specs)
        bad = [b for b in self.bundle_indices if not 0 <= b < count]
        if not self.bundle_indices or bad or len(set(self.bundle_indices)) != len(self.bundle_indices):
            raise DeploymentConfigError(
                f"bundle_indices={self.bundle_indices} must be distinct indices into the placement group's "
                f"{count} bundle(s), one per rank, e.g. {tuple(range(min(count, 2)))}")
        return self


class DeploymentConfig(ConfigModel):
    """How many replicas, and where their ranks run. Topology of one replica is in ParallelConfig."""

    mode: Mode = Field("auto", description="auto, inline, local, cluster or external (see the module table).")
    replica_count: int = Field(1, ge=1, le=1024, description="Independent model replicas; they share no process group.")
    devices: tuple[int, ...] | None = Field(
        None, description="Logical device index per rank, replica after replica (CUDA_VISIBLE_DEVICES order). "
        "Explicit devices select local mode.")
    process_config: WorkerSupervisorConfig = Field(
        default_factory=WorkerSupervisorConfig, description="Ports and deadlines of the rank workers.")
    batching: BatchingConfig = Field(
        default_factory=BatchingConfig, description="Dynamic batching of queued requests inside each replica "
        "(plugins with step_batch); off by default.")
    address: str | None = Field(
        None, description="Ray address for cluster mode ('auto', 'ray://host:10001', 'host:6379').")
    placement_strategy: Strategy = Field(
        "STRICT_PACK", description="Placement-group strategy of each replica's bundles (STRICT_PACK keeps a "
        "replica on one node).")
    spread_replicas: bool = Field(
        True, description="Prefer different nodes for different replicas where the cluster allows.")
    cpus_per_rank: float = Field(1.0, gt=0, le=1024, description="CPUs reserved per rank bundle.")
    runtime_env: dict[str, Any] | None = Field(
        None, description="Ray runtime_env for the rank actors (e.g. working_dir, pip, env_vars).")
    placement: PlacementSpec | tuple[PlacementSpec, ...] | None = Field(
        None, description="Run in placement groups someone else owns: one PlacementSpec per replica (a single "
        "spec for one replica). None reserves a placement group per replica.")
    ray_init_kwargs: dict[str, Any] | None = Field(
        None, description="Extra ray.init() arguments used when the engine starts or joins Ray (local mode).")
    routing: Literal["least_loaded", "affinity"] = Field(
        "least_loaded", description="How the engine picks a replica: the fewest routed, unfinished requests; or "
        "'affinity': requests with the same Entry.affinity_key (e.g. the samples of one prompt) go to the replica "
        "the key last used while it holds at most affinity_slack more than the least loaded one.")
    affinity_slack: int = Field(
        4, ge=0, le=1 << 20, description="routing='affinity': how many more routed, unfinished requests a key's "
        "replica may hold than the least loaded one before the key moves.")

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, devices: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if devices is not None:
            if not devices:
                raise DeploymentConfigError("devices=() lists no device; pass None to let Ray assign devices")
            if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
                raise DeploymentConfigError(f"devices={devices} must be distinct non-negative indices, e.g. (0, 1)")
        return devices

    @model_validator(mode="after")
    def _check_mode(self) -> "DeploymentConfig":
        if self.address is not None and self.mode not in ("cluster", "auto"):
            raise DeploymentConfigError(f"address={self.address!r} only applies to mode='cluster', not {self.mode!r}")
        if self.mode in ("inline", "external") and self.devices is not None:
            raise DeploymentConfigError(
                f"devices={self.devices} needs managed workers; mode={self.mode!r} runs in the caller's process(es)")
        if self.placement is not None and self.mode in ("inline", "external"):
            raise DeploymentConfigError(f"placement=... runs rank actors in a placement group; mode={self.mode!r} "
                                        "has none (use mode='auto', 'local' or 'cluster')")
        if self.placement is not None and len(self.placements) != self.replica_count:
            raise DeploymentConfigError(
                f"placement lists {len(self.placements)} PlacementSpec(s) but replica_count={self.replica_count}; "
                "give one PlacementSpec per replica")
        if self.placement is not None and self.devices is not None:
            raise DeploymentConfigError("devices=... and placement=... both say where ranks run; give one of them")
        if self.mode in ("inline", "external") and self.replica_count != 1:
            raise DeploymentConfigError(
                f"mode={self.mode!r} runs exactly one replica, got replica_count={self.replica_count}; use "
                "DeploymentConfig.local(replica_count=...) or start one launcher job per replica")
        return self

    @classmethod
    def local(cls, devices: tuple[int, ...] | None = None, replica_count: int = 1,
              process_config: WorkerSupervisorConfig | None = None, **kwargs: Any) -> "DeploymentConfig":
        """Ray actors on this machine; starts a local Ray instance when none is running."""
        return cls(mode="local", devices=devices, replica_count=replica_count,
                   process_config=process_config or WorkerSupervisorConfig(), **kwargs)

    @classmethod
    def cluster(cls, address: str = "auto", replica_count: int = 1,
                process_config: WorkerSupervisorConfig | None = None, **kwargs: Any) -> "DeploymentConfig":
        """Attach to an existing Ray cluster; replicas may land on any node."""
        return cls(mode="cluster", address=address, replica_count=replica_count,
                   process_config=process_config or WorkerSupervisorConfig(), **kwargs)

    @classmethod
    def external(cls, **kwargs: Any) -> "DeploymentConfig":
        """Ranks started by an external launcher (torchrun): each process is one rank of one replica."""
        return cls(mode="external", **kwargs)

    @property
    def placements(self) -> tuple[PlacementSpec, ...]:
        """One PlacementSpec per replica, or () when every replica reserves its own group."""
        if self.placement is None:
            return ()
        return self.placement if isinstance(self.placement, tuple) else (self.placement,)

    def resolve_mode(self, ranks_per_replica: int) -> str:
        """The mode `auto` stands for, by the module table."""
        if self.mode == "inline" and ranks_per_replica != 1:
            raise DeploymentConfigError(
                f"mode='inline' runs one rank, but the parallel config needs {ranks_per_replica} ranks per replica; "
                "use DeploymentConfig.local() or DeploymentConfig.external() under torchrun")
        self._check_device_count(ranks_per_replica)
        for spec in self.placements:
            if len(spec.bundle_indices) != ranks_per_replica:
                raise DeploymentConfigError(
                    f"PlacementSpec bundle_indices={spec.bundle_indices} name {len(spec.bundle_indices)} bundle(s) but "
                    f"the parallel config needs {ranks_per_replica} rank(s) per replica; list one bundle per rank")
        if self.mode != "auto":
            return self.mode
        if self.address is not None:
            return "cluster"
        if ranks_per_replica > 1 or self.replica_count > 1 or self.devices is not None or self.placement is not None:
            return "local"
        return "inline"

    def _check_device_count(self, ranks_per_replica: int) -> None:
        """One device per rank, checked before anything starts (no Ray needed)."""
        need = self.replica_count * ranks_per_replica
        if self.devices is not None and len(self.devices) != need:
            raise DeploymentConfigError(
                f"devices={self.devices} lists {len(self.devices)} devices but {self.replica_count} replica(s) x "
                f"{ranks_per_replica} rank(s) need exactly {need}; list one device per rank, replica after replica")
