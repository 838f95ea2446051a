"""Find a plugin: registered name, `phyai_ray.plugins` entry point, `pkg.mod:Entry` path, or object."""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, TypeVar

from phyai_ray.errors import PluginError
from phyai_ray.plugins.entry import Entry

ENTRY_POINT_GROUP = "phyai_ray.plugins"
_REGISTRY: dict[str, type[Entry]] = {}
E = TypeVar("E", bound=type)


def register_plugin(cls: E) -> E:
    """Class decorator: make an `Entry` subclass findable by its `name`."""
    if not (isinstance(cls, type) and issubclass(cls, Entry)):
        raise PluginError(f"register_plugin expects an Entry subclass, got {cls!r}")
    if not cls.name:
        raise PluginError(f"{cls.__qualname__} has no `name`; set name = '...' before registering it")
    old = _REGISTRY.get(cls.name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise PluginError(f"plugin name {cls.name!r} is already registered by "
                          f"{old.__module__}.{old.__qualname__}; pick another name")
    _REGISTRY[cls.name] = cls
    return cls


def registered_names() -> list[str]:
    """Names registered in code or advertised by installed entry points."""
    points = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(set(_REGISTRY) | points)


def resolve_plugin(spec: Any) -> Entry:
    """Turn a name, import path, Entry class or Entry instance into an Entry instance."""
    if isinstance(spec, Entry):
        return spec
    if isinstance(spec, type) and issubclass(spec, Entry):
        return spec()
    if not isinstance(spec, str) or not spec:
        raise PluginError(f"plugin must be a name, 'package.module:Entry', an Entry class or instance; got {spec!r}")
    if ":" in spec:
        return _as_entry(_import_path(spec), spec)
    if spec in _REGISTRY:
        return _REGISTRY[spec]()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            return _as_entry(_load_entry_point(ep), spec)
    raise PluginError(f"no plugin named {spec!r}; known: {registered_names() or 'none'}. Register one with "
                      f"@register_plugin, advertise it in the {ENTRY_POINT_GROUP!r} entry-point group, or "
                      "pass 'package.module:EntryClass'")


def _import_path(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"cannot import plugin module {module_name!r} from {path!r}: {exc}; is it "
                          "installed (or shipped with runtime_env) where the engine runs?") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj


def _load_entry_point(ep: metadata.EntryPoint) -> Any:
    try:
        return ep.load()
    except Exception as exc:
        raise PluginError(f"entry point {ep.name!r} = {ep.value!r} failed to load: {exc}") from exc


def _as_entry(obj: Any, origin: str) -> Entry:
    if isinstance(obj, Entry):
        return obj
    if isinstance(obj, type) and issubclass(obj, Entry):
        return obj()
    raise PluginError(f"{origin!r} resolved to {obj!r}, which is not an Entry subclass or instance")
