"""The external executor: ranks started by a launcher such as torchrun.

Run one process per rank, e.g. `torchrun --nproc_per_node=2 examples/reference_torchrun.py`. Each
process is one rank of ONE replica; the engine does not broadcast, so every rank must call
`step()` with the same requests in the same order. The output rank returns the result, the others
`None`. The process groups come from the same topology as every other mode; RANK / WORLD_SIZE only
say which process this is. The default world belongs to the launcher: `close()` destroys the
engine's named groups but leaves the world up for the next engine of the process.
"""

from __future__ import annotations

import os
from typing import Any

from phyai_ray.errors import DeploymentConfigError
from phyai_ray.executors.inline import InlineExecutor
from phyai_ray.plugins.entry import Entry
from phyai_ray.rank.runner import RankRunner, init_distributed, make_context
from placement.topology import Topology

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launcher_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's variables; a clear error when the process was not started by one."""
    environ = os.environ if environ is None else environ
    missing = [v for v in _LAUNCHER_VARS if v not in environ]
    if missing:
        raise DeploymentConfigError(
            f"DeploymentConfig.external() needs the launcher's {', '.join(missing)} in the environment; "
            "start the script with e.g. `torchrun --nproc_per_node=2 script.py`")
    return {v: environ[v] for v in _LAUNCHER_VARS}


def check_world(topology: Topology, env: dict[str, str]) -> int:
    """This process's rank; the launcher's world must be exactly one replica."""
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    if world != topology.world_size:
        raise DeploymentConfigError(
            f"the launcher started WORLD_SIZE={world} processes but the parallel config needs "
            f"{topology.world_size} ranks per replica; use --nproc_per_node/--nnodes that multiply to "
            f"{topology.world_size}, or change ParallelConfig")
    return rank


class ExternalExecutor(InlineExecutor):
    """One rank of a launcher-started replica, run on the engine's thread in this process.

    Every rank's engine must run the same requests in the same order, so nothing here may depend
    on local timing (`lockstep`): no queue bound (one rank could shed what another admits), no
    batching (each engine would form batches from its own timing), every request goes straight to
    the plugin's thread, and one whose deadline passed still runs (its future fails). Never on the
    caller's thread either: the engine's thread built the launcher's groups, and steps of a launcher
    world run on a thread that owns none of them made torchrun ranks abort at teardown ("terminate
    called without an active exception")."""

    name = "torchrun"
    runs_here = False
    lockstep = True
    skips_expired = False
    worker_idle_exit_s = None  # the engine's thread built the launcher's groups: it must stay

    def __init__(self, entry: Entry, plugin_args: dict[str, Any], parallel: Any, device_config: Any, *,
                 startup_timeout_s: float, shutdown_timeout_s: float = 10.0,
                 collective_timeout_s: float = 600.0) -> None:
        topology = Topology.from_parallel(parallel)
        env = launcher_env()
        rank = check_world(topology, env)
        self.rank, self.output_rank, self.world_size = rank, topology.output_rank, topology.world_size
        self._destroyed = False

        def build() -> RankRunner:
            device = _device(device_config.resolve_target(), int(env["LOCAL_RANK"]))
            groups = init_distributed(topology, rank, device.type, "env://", collective_timeout_s)
            groups.install()
            ctx = make_context(topology=topology, groups=groups, rank=rank, replica_index=0, device=device,
                               dtype=device_config.torch_dtype(), parallel=parallel, local_rank=int(env["LOCAL_RANK"]))
            return RankRunner(entry, plugin_args, ctx)

        super().__init__(build, startup_timeout_s=startup_timeout_s, shutdown_timeout_s=shutdown_timeout_s,
                         thread_name="phyai-external-0")

    def close(self, drain: bool) -> None:
        """Stop, then destroy this engine's named groups. The launcher's world stays up, so a later
        engine in the same process joins it again (re-initialising it on torchrun's store hangs)."""
        super().close(drain)
        if not self._destroyed:
            self._destroyed = True
            from phyai_ray.process_groups import uninstall
            uninstall()
            self._runner.ctx.groups.destroy()


def _device(target: str, local_rank: int) -> Any:
    import torch

    if target == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
