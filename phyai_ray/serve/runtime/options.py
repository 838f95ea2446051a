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

from pydantic import Field, field_validator, model_validator

from phyai_ray.config.base import ConfigModel
from phyai_ray.config.deployment import DeploymentConfig
from phyai_ray.config.engine import EngineArgs
from phyai_ray.flags import build_configs, config_flags

API_KEY_ENV = "PHYAI_RAY_API_KEY"
API_KEYS_ENV = "PHYAI_RAY_API_KEYS"  # a JSON object {tenant: key}: several callers, each its own tenant
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_TENSORS = 1024  # the codec's defaults (protocols/codec.py imports torch; this module must not)
DEFAULT_MAX_TOTAL_BYTES = 1024 * 1024 * 1024
OVERLOAD_STATUSES = (503, 429)


class ServeOptions(ConfigModel):
    """How the group deployment guards, routes, scales and supervises its replica groups."""

    api_key: str | None = Field(
        None, min_length=1, description="Require 'Authorization: Bearer <key>' on every route but /healthz and "
        "/readyz. None: no key (bind to 127.0.0.1 then).")
    api_keys: dict[str, str] | None = Field(
        None, description="Several callers, each a tenant: {tenant name: key}. Each key is accepted like api_key; "
        "what is listed per caller (video jobs) is scoped to the tenant whose key came with the request (another "
        "tenant's job id is a 404). api_key, when also given, is tenant 'default'.")
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1, le=2**40, description="Largest accepted request body; larger ones get 413.")
    max_tensors: int = Field(
        DEFAULT_MAX_TENSORS, ge=1, le=10**7, description="Most tensors one request may carry; more get 422.")
    max_tensor_bytes: int = Field(
        DEFAULT_MAX_TOTAL_BYTES, ge=1, le=2**40, description="Most bytes the tensors of one request may "
        "hold together (decoded); more get 422.")
    rebuild_failed: bool = Field(
        False, description="Restart a failed replica group in place, inside its Serve replica and placement "
        "group (Engine.restart_replica), instead of reporting unhealthy (which makes Serve replace the replica).")
    min_replicas: int | None = Field(
        None, ge=0, le=1024, description="Autoscaling: fewest replica groups. Setting min/max_replicas turns "
        "Serve autoscaling on (whole groups are added and removed); otherwise `replicas` groups run.")
    max_replicas: int | None = Field(None, ge=1, le=1024, description="Autoscaling: most replica groups.")
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="Autoscaling: requests in flight per group that Serve aims for (default 2).")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Further Serve autoscaling_config keys (upscale_delay_s, downscale_delay_s, "
        "look_back_period_s, ...), merged with min/max_replicas and target_ongoing_requests.")
    max_queued_requests: int = Field(
        -1, ge=-1, description="Serve's queue in each proxy and handle in front of the groups (-1: no "
        "limit); past it Serve answers 503 at once.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve calls check_health.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="How long one check_health may take.")
    max_ongoing_requests: int = Field(
        256, ge=1, description="Requests one group (one Serve replica) accepts at once; they wait in its "
        "engine queue and max_ongoing_requests (engine) of them run at its ranks.")
    model_name: str | None = Field(
        None, min_length=1, description="The served model's name (OpenAI's `model`, the Open Inference Protocol's "
        "model name); default: the plugin's (hf_causal_lm: the checkpoint folder's name).")
    stream_interval: int = Field(
        1, ge=1, le=1024, description="Token plugins: streamed /v1/completions write at most one event per this "
        "many token steps (the first token at once, the rest in groups; vLLM's stream_interval). 1: every "
        "token as it comes; larger: fewer writes through the proxy, more tokens per second, burstier streams.")
    overload_status: int = Field(
        503, description="HTTP status of a request shed because every replica group's queue is full: 503 or 429 "
        "(both with Retry-After).")
    # -- the protocols existing clients speak: OIP over HTTP and gRPC, openpi (serve/protocols/oip/, openpi.py)
    oip_http: bool = Field(True, description="Serve the Open Inference Protocol v2 over HTTP (/v2/...).")
    openpi: bool = Field(True, description="Serve openpi's robot-policy WebSocket (/v1/openpi).")
    grpc_port: int | None = Field(
        None, ge=1, le=65535, description="Serve the Open Inference Protocol's gRPC service "
        "(inference.GRPCInferenceService) through Serve's gRPC proxy on this port; off when not given.")
    # -- OpenAI's Videos API for world models (serve/protocols/openai/videos.py)
    video_dir: str | None = Field(
        None, description="Where video jobs and their MP4s live, read by every replica group (across nodes: a "
        "shared filesystem); default: a folder under the system's temporary directory.")
    video_ttl_s: float = Field(3600.0, gt=0, description="A finished video job (and its MP4) is kept this long.")
    video_max_bytes: int = Field(10 << 30, ge=1, description="Most bytes of finished videos kept; past it the "
                                 "oldest finished jobs are deleted.")
    video_stale_s: float = Field(30.0, gt=0, le=3600, description="A queued or running video job whose group has "
                                 "not reported for this long (its process died) is failed by the next reader.")
    video_crf: int = Field(12, ge=0, le=51, description="x264's constant rate factor of the served MP4s (0 "
                           "lossless luma, 18 visually lossless, 23 x264's default; lower: larger files).")

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        """Serve's autoscaling_config, or None for a fixed number of groups."""
        keys = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests}
        given = {k: v for k, v in keys.items() if v is not None}
        if not given and not self.autoscaling_config:
            return None
        return {**(self.autoscaling_config or {}), **given}

    def key_table(self) -> dict[str, str] | None:
        """{key: tenant} of every accepted key (api_key is tenant 'default'); None: no key, every caller is let in."""
        table = {key: tenant for tenant, key in (self.api_keys or {}).items()}
        if self.api_key is not None:
            table.setdefault(self.api_key, "default")
        return table or None

    @field_validator("api_keys")
    @classmethod
    def _distinct_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        empty = [tenant for tenant, key in value.items() if not tenant or not key]
        if empty:
            raise ValueError(f"api_keys: every tenant needs a non-empty name and key; empty for {empty}")
        if len(set(value.values())) != len(value):
            raise ValueError("api_keys: two tenants share a key; each tenant needs a key of its own")
        return value

    @model_validator(mode="after")
    def _check_scaling(self) -> "ServeOptions":
        low, high = self.min_replicas, self.max_replicas
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_replicas={low} is larger than max_replicas={high}; e.g. min_replicas=1 "
                             "max_replicas=4")
        return self

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
        setattr(ns, f"{section}.{field}", _int_tuple(value, field) if field in _INT_TUPLES else value)
    engine, deployment = build_configs(ns)
    given = {k: _json_value(v) if k in ("autoscaling_config", "api_keys") else v
             for k, v in values.items() if k in option_names}
    given.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
    if os.environ.get(API_KEYS_ENV) and "api_keys" not in given:
        given["api_keys"] = _json_value(os.environ[API_KEYS_ENV])
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


def _json_value(value: Any) -> Any:
    """A dict option given as a JSON string on the command line (YAML dicts pass through)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{value!r} must be a JSON object, e.g. '{{\"upscale_delay_s\": 5}}': {exc}") from None
    return value


_INT_TUPLES = ("devices", "preferred_batch_sizes")


def _int_tuple(value: Any, field: str) -> Any:
    """`devices=0,1` (a string from the command line) -> (0, 1); YAML lists pass through."""
    if isinstance(value, str):
        try:
            return tuple(int(part) for part in value.split(",") if part.strip())
        except ValueError:
            raise ValueError(f"{field}={value!r} must be comma-separated integers, e.g. {field}=0,1") from None
    return value
