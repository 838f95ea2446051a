"""Config flags: the command-line form of the pydantic config models, shared by `phyai-ray` and Serve.

    --pp-size 4 --dense-tp-size 2 --replicas 2 --device cpu      (phyai-ray plan / serve)
    pp_size=4 dense_tp_size=2 replicas=2 device=cpu              (serve run phyai_ray.serve:build_app)

Every field of the models in GENERATED becomes `--<prefix><field-name>`; RENAMED lists the
hand-named ones. Type, choices, help text and shown default come from the fields, so `--help`
cannot drift from the configs. A flag left out stays unset in the config: a parallel domain with
no flag is inferred as data-parallel, exactly as `ParallelConfig` documents. `build_configs`
turns parsed flags (an argparse namespace whose keys are `section.field`) into the configs.

Importing this module loads pydantic and the config models only (no Ray, no torch).
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from phyai_ray.config.batching import BatchingConfig
from phyai_ray.config.deployment import DeploymentConfig, WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig, EngineArgs, EngineConfig
from phyai_ray.config.parallel import (AttentionParallelConfig, DenseParallelConfig, MoeParallelConfig,
                                       OuterParallelConfig, ParallelConfig)
from phyai_ray.errors import PhyAIError

# (section, model, flag prefix): every field of `model` becomes `--<prefix><field-name>`.
GENERATED: tuple[tuple[str, type[BaseModel], str], ...] = (
    ("outer", OuterParallelConfig, ""),
    ("dense", DenseParallelConfig, "dense-"),
    ("attention", AttentionParallelConfig, "attention-"),
    ("moe", MoeParallelConfig, "moe-"),
    ("process", WorkerSupervisorConfig, ""),
    ("batching", BatchingConfig, ""),
)
# (flag, section, model, field): hand-named flags whose type, choices and help still come from the model.
RENAMED: tuple[tuple[str, str, type[BaseModel], str], ...] = (
    ("--replicas", "deployment", DeploymentConfig, "replica_count"),
    ("--mode", "deployment", DeploymentConfig, "mode"),
    ("--address", "deployment", DeploymentConfig, "address"),
    ("--devices", "deployment", DeploymentConfig, "devices"),
    ("--placement-strategy", "deployment", DeploymentConfig, "placement_strategy"),
    ("--cpus-per-rank", "deployment", DeploymentConfig, "cpus_per_rank"),
    ("--device", "device", DeviceConfig, "target"),
    ("--dtype", "device", DeviceConfig, "params_dtype"),
)


class ConfigFlagError(PhyAIError, ValueError):
    """Flags that do not form a valid configuration; the message names the flags."""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints, e.g. 0,1,2,3") from None


def _flag_kind(annotation: Any) -> dict[str, Any]:
    """argparse `type`/`choices` for a field annotation (Optional unwrapped)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_kind(args[0])
    if typing.get_origin(annotation) is Literal:
        return {"type": str, "choices": list(args)}
    if annotation in (int, float, str):
        return {"type": annotation, "metavar": {int: "INT", float: "FLOAT"}.get(annotation)}
    if typing.get_origin(annotation) is tuple and args[:1] == [int]:
        return {"type": _int_list, "metavar": "I,J,..."}
    raise TypeError(f"no command-line form for a field of type {annotation!r}; add one to phyai_ray.flags")


def _add_field_flag(parser: Any, flag: str, section: str, model: type[BaseModel], name: str) -> None:
    field = model.model_fields[name]
    help_text = (field.description or "").replace("%", "%%") + f" (default: {field.default})"
    kind = _flag_kind(field.annotation)
    if kind.get("metavar") is None and "choices" not in kind:
        kind["metavar"] = name.upper()
    parser.add_argument(flag, dest=f"{section}.{name}", default=None, help=help_text, **kind)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add every generated and renamed config flag, one argument group per section."""
    groups: dict[str, Any] = {}

    def group(section: str, model: type[BaseModel]) -> Any:
        if section not in groups:
            groups[section] = parser.add_argument_group(section, model.__doc__)
        return groups[section]

    for section, model, prefix in GENERATED:
        for name in model.model_fields:
            _add_field_flag(group(section, model), f"--{prefix}{name.replace('_', '-')}", section, model, name)
    for flag, section, model, name in RENAMED:
        _add_field_flag(group(section, model), flag, section, model, name)


def config_flags() -> dict[str, tuple[str, str]]:
    """flag -> (section, field) of every config flag, for error messages and tests."""
    flags = {f"--{prefix}{name.replace('_', '-')}": (section, name)
             for section, model, prefix in GENERATED for name in model.model_fields}
    flags.update({flag: (section, name) for flag, section, _, name in RENAMED})
    return flags


def _given(ns: argparse.Namespace, section: str) -> dict[str, Any]:
    """The fields of `section` the user actually gave (argparse defaults are None)."""
    prefix = section + "."
    return {k[len(prefix):]: v for k, v in vars(ns).items() if k.startswith(prefix) and v is not None}


def _build(model: type[BaseModel], section: str, **values: Any) -> Any:
    """`model(**values)`, with pydantic errors turned into one line that names the flags."""
    try:
        return model(**values)
    except ValidationError as exc:
        raise ConfigFlagError("; ".join(_describe(err, section) for err in exc.errors())) from None


def _describe(err: Any, section: str) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    if not err["loc"]:
        return msg
    field = str(err["loc"][0])
    flag = next((f for f, key in config_flags().items() if key == (section, field)), field)
    return f"{flag}={err['input']!r}: {msg}" if flag.startswith("--") else f"{field}: {msg}"


def build_parallel(ns: argparse.Namespace) -> ParallelConfig:
    """The ParallelConfig the flags describe; domains without a flag stay unset (inferred)."""
    domains = {section: _build(model, section, **_given(ns, section))
               for section, model, _ in GENERATED[1:4] if _given(ns, section)}
    outer = _build(OuterParallelConfig, "outer", **_given(ns, "outer"))
    return _build(ParallelConfig, "parallel", outer=outer, **domains)


def build_configs(ns: argparse.Namespace) -> tuple[EngineArgs, DeploymentConfig]:
    """(EngineArgs, DeploymentConfig) from parsed flags; raises ConfigFlagError on bad combinations."""
    device = _build(DeviceConfig, "device", **_given(ns, "device"))
    config = EngineConfig(device=device, parallel=build_parallel(ns))
    engine = _build(EngineArgs, "engine", plugin=getattr(ns, "plugin", None),
                    plugin_args=getattr(ns, "plugin_args", None) or {}, config=config)
    process = _build(WorkerSupervisorConfig, "process", **_given(ns, "process"))
    batching = _build(BatchingConfig, "batching", **_given(ns, "batching"))
    deployment = _build(DeploymentConfig, "deployment", process_config=process, batching=batching,
                        **_given(ns, "deployment"))
    return engine, deployment
