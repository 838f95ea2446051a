"""Settings of the HTTP edge, and the `key=value` arguments of `serve run phyai_ray.serve:build_app`.

    serve run phyai_ray.serve:build_app plugin=reference_dit dense_tp_size=2 attention_tp_size=2 \
        replicas=2 device=cpu api_key=secret 'plugin_args={"hidden": 64}'

Serve hands the builder a dict of strings (from the command line) or of YAML values (from a config
file's `args:`). Engine keys are the `phyai-ray serve` flags with `_` for `-` (`dense_tp_size`,
`replicas`, `execution_timeout_s`, `devices=0,1`, ...), so both front ends accept the same names;
edge keys are the fields of `ServeOptions`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Mapping

from pydantic import Field, field_validator

from phyai_ray.config.base import ConfigModel
from phyai_ray.config.deployment import DeploymentConfig
from phyai_ray.config.engine import EngineArgs
from phyai_ray.flags import build_configs, config_flags

API_KEY_ENV = "PHYAI_RAY_API_KEY"
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
OVERLOAD_STATUSES = (503, 429)


class ServeOptions(ConfigModel):
    """How the ingress deployment guards and supervises the engine it owns."""

    api_key: str | None = Field(
        None, min_length=1, description="Require 'Authorization: Bearer <key>' on every route but /healthz and "
        "/readyz. None: no key (bind to 127.0.0.1 then).")
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1, le=2**40, description="Largest accepted request body; larger ones get 413.")
    rebuild_failed: bool = Field(
        False, description="Restart each failed replica group in place (Engine.restart_replica) while the "
        "others keep serving, instead of reporting unhealthy once none can serve (which makes Serve replace it).")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve calls check_health.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="How long one check_health may take.")
    max_ongoing_requests: int = Field(
        256, ge=1, description="Concurrent requests the ingress accepts; the engine's dispatcher queues them "
        "on replicas (fewest in flight first).")
    overload_status: int = Field(
        503, description="HTTP status of a request shed because every replica group's queue is full: 503 or 429 "
        "(both with Retry-After).")

    @field_validator("overload_status")
    @classmethod
    def _known_overload_status(cls, value: int) -> int:
        if value not in OVERLOAD_STATUSES:
            raise ValueError(f"overload_status must be one of {OVERLOAD_STATUSES}, got {value}")
        return value


def app_arg_keys() -> dict[str, tuple[str, str]]:
    """`dense_tp_size` -> ("dense", "tp_size"): every engine key `build_app` accepts."""
    return {flag[2:].replace("-", "_"): target for flag, target in config_flags().items()}


def parse_app_args(args: Mapping[str, Any]) -> tuple[EngineArgs, DeploymentConfig, ServeOptions]:
    """Turn Serve's builder arguments into (EngineArgs, DeploymentConfig, ServeOptions)."""
    values = {str(k).replace("-", "_"): v for k, v in args.items()}
    if "plugin" not in values:
        raise ValueError(f"build_app needs plugin=<name or package.module:Entry>; got keys {sorted(values)}. "
                         "e.g. serve run phyai_ray.serve:build_app plugin=reference_dit dense_tp_size=2")
    option_names = set(ServeOptions.model_fields)
    engine_keys = app_arg_keys()
    unknown = sorted(set(values) - option_names - set(engine_keys) - {"plugin", "plugin_args"})
    if unknown:
        raise ValueError(f"unknown build_app argument(s) {unknown}; known: plugin, plugin_args, "
                         f"{', '.join(sorted(option_names))}, {', '.join(sorted(engine_keys))}")
    ns = argparse.Namespace(plugin=values["plugin"], plugin_args=_plugin_args(values.get("plugin_args")))
    for key, (section, field) in engine_keys.items():
        value = values.get(key)
        setattr(ns, f"{section}.{field}", _int_tuple(value) if field == "devices" else value)
    engine, deployment = build_configs(ns)
    given = {k: v for k, v in values.items() if k in option_names}
    given.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
    return engine, deployment, ServeOptions(**given)


def _plugin_args(value: Any) -> dict[str, Any]:
    if value is None or isinstance(value, dict):
        return dict(value or {})
    try:
        parsed = json.loads(value)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"plugin_args must be a JSON object, e.g. plugin_args='{{\"hidden\": 64}}': {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"plugin_args must be a JSON object, got {type(parsed).__name__}: {value!r}")
    return parsed


def _int_tuple(value: Any) -> Any:
    """`devices=0,1` (a string from the command line) -> (0, 1); YAML lists pass through."""
    if isinstance(value, str):
        try:
            return tuple(int(part) for part in value.split(",") if part.strip())
        except ValueError:
            raise ValueError(f"devices={value!r} must be comma-separated integers, e.g. devices=0,1") from None
    return value
