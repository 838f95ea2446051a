"""Replica backends by deployment mode: how the replicas of a mode are started.

    inline, external     built in (phyai_ray.executors.inline / .external)
    local, cluster       Ray replica groups: the `actors` package registers them through the
                         `phyai_ray.backends` entry point (pyproject.toml), loaded the first time
                         such a mode is asked for, so Ray is imported only then

`phyai_ray` never names `actors`: imports run one way, actors -> phyai_ray -> placement
(tests/test_import_direction.py). A backend is `start(mode, entry, args, deployment) -> [executor]`
and `restart(index, mode, entry, args, deployment) -> executor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

GROUP = "phyai_ray.backends"


@dataclass(frozen=True)
class Backend:
    start: Callable[..., list[Any]]
    restart: Callable[..., Any] | None = None


_BACKENDS: dict[str, Backend] = {}
_loaded = False


def register_backend(modes: tuple[str, ...], backend: Backend) -> None:
    """Make `backend` start the replicas of every mode in `modes` (a backend package calls this)."""
    for mode in modes:
        _BACKENDS[mode] = backend


def backend(mode: str) -> Backend:
    """The backend of `mode`, loading the installed ones (entry points) on first need."""
    global _loaded
    if mode not in _BACKENDS and not _loaded:
        _loaded = True
        for point in entry_points(group=GROUP):
            point.load()()  # each names a function that registers its modes
    if mode not in _BACKENDS:
        raise ValueError(f"no replica backend for deployment mode {mode!r}; known: {sorted(_BACKENDS)} (the Ray "
                         f"modes 'local' and 'cluster' come with the installed package: pip install -e .)")
    return _BACKENDS[mode]
