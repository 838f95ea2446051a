"""Replica backends, registered by what they are, and the one table that maps a deployment mode to one.

    mode       backend    how its replicas run (each a ScheduledReplica over one executor)
    inline     inline     one rank in this process (InlineExecutor, executors/inline.py)
    external   torchrun   this process is one rank of a launcher-started replica (ExternalExecutor, external.py)
    local      ray        Ray replica groups on this machine (RayExecutor, actors/launch.py)
    cluster    ray        Ray replica groups on a cluster

A backend is `start(mode, entry, args, deployment) -> [replica]` and optionally
`restart(index, mode, entry, args, deployment) -> replica`; a replica is any object satisfying
`Replica` (replica.py), so a backend whose replicas schedule themselves returns its own.

`phyai_ray` never names `actors`: imports run one way, actors -> phyai_ray -> placement
(tests/test_import_direction.py). The `ray` backend registers itself through the
`phyai_ray.backends` entry point (pyproject.toml), loaded the first time a mode needs it, so Ray is
imported only then.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

GROUP = "phyai_ray.backends"
MODES = {"inline": "inline", "external": "torchrun", "local": "ray", "cluster": "ray"}


@dataclass(frozen=True)
class Backend:
    start: Callable[..., list[Any]]
    restart: Callable[..., Any] | None = None


_BACKENDS: dict[str, Backend] = {}
_loaded = False


def register_backend(name: str, backend: Backend) -> None:
    """Make `backend` the one named `name` (see MODES for the modes it serves)."""
    _BACKENDS[name] = backend


def backend(mode: str) -> Backend:
    """The backend that serves `mode`, loading the installed ones (entry points) on first need."""
    global _loaded
    name = MODES.get(mode)
    if name is None:
        raise ValueError(f"unknown deployment mode {mode!r}; known: {sorted(MODES)}")
    if name not in _BACKENDS and not _loaded:
        _loaded = True
        for point in entry_points(group=GROUP):
            point.load()()  # each names a function that registers its backend
    if name not in _BACKENDS:
        raise ValueError(f"no {name!r} replica backend for deployment mode {mode!r}; registered: "
                         f"{sorted(_BACKENDS)} (the Ray backend comes with the installed package: pip install -e .)")
    return _BACKENDS[name]


def _start_inline(mode: str, entry: Any, args: Any, deployment: Any) -> list[Any]:
    from phyai_ray.executors.base import ScheduledReplica
    from phyai_ray.executors.inline import InlineExecutor, build_inline_runner

    parallel, device, proc = args.config.parallel, args.config.device, deployment.process_config
    ranks = InlineExecutor(lambda: build_inline_runner(entry, args.plugin_args, parallel, device),
                            startup_timeout_s=proc.startup_timeout_s, shutdown_timeout_s=proc.shutdown_timeout_s)
    return [ScheduledReplica(ranks, max_ongoing=1, max_queued=proc.max_queued_requests, step_limit_s=proc.step_limit_s,
                             hang_limit_s=proc.hang_limit_s, cap_s=proc.execution_timeout_s,
                             batching=deployment.batching, entry=ranks.entry)]


def _start_torchrun(mode: str, entry: Any, args: Any, deployment: Any) -> list[Any]:
    from phyai_ray.executors.base import ScheduledReplica
    from phyai_ray.executors.external import ExternalExecutor

    proc = deployment.process_config
    ranks = ExternalExecutor(entry, args.plugin_args, args.config.parallel, args.config.device,
                              startup_timeout_s=proc.startup_timeout_s, shutdown_timeout_s=proc.shutdown_timeout_s,
                              collective_timeout_s=proc.collective_timeout_s)
    return [ScheduledReplica(ranks, max_ongoing=None, max_queued=None, step_limit_s=proc.step_limit_s,
                             hang_limit_s=proc.hang_limit_s)]


register_backend("inline", Backend(start=_start_inline))
register_backend("torchrun", Backend(start=_start_torchrun))
