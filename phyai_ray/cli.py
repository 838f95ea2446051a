"""The `phyai-ray` command: plan a topology without starting anything, or serve a plugin over HTTP.

    phyai-ray --version
    phyai-ray plan --pp-size 4 --dense-tp-size 2          # 8 ranks: tp [0,1] [2,3] ..., pp [0,2,4,6] [1,3,5,7]
    phyai-ray serve reference_dit --dense-tp-size 2 --attention-tp-size 2 --replicas 2 --port 8000

The parallel-size and deadline flags are generated from the pydantic config models (flag name,
type, choices, help text and shown default all come from the fields), so `--help` cannot drift
from the configs. A flag left out stays unset in the config: a parallel domain with no flag is
inferred as data-parallel, exactly as `ParallelConfig` documents.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ValidationError

from phyai_ray import __version__
from phyai_ray.config.deployment import DeploymentConfig, WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig, EngineArgs, EngineConfig
from phyai_ray.config.parallel import (AttentionParallelConfig, DenseParallelConfig, MoeParallelConfig,
                                       OuterParallelConfig, ParallelConfig)
from phyai_ray.errors import PhyAIError

API_KEY_ENV = "PHYAI_RAY_API_KEY"
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

# (section, model, flag prefix): every field of `model` becomes `--<prefix><field-name>`.
GENERATED: tuple[tuple[str, type[BaseModel], str], ...] = (
    ("outer", OuterParallelConfig, ""),
    ("dense", DenseParallelConfig, "dense-"),
    ("attention", AttentionParallelConfig, "attention-"),
    ("moe", MoeParallelConfig, "moe-"),
    ("process", WorkerSupervisorConfig, ""),
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


class CliConfigError(PhyAIError, ValueError):
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
    raise TypeError(f"no command-line form for a field of type {annotation!r}; add one to phyai_ray.cli")


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
        raise CliConfigError("; ".join(_describe(err, section) for err in exc.errors())) from None


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
    """(EngineArgs, DeploymentConfig) from parsed flags; raises CliConfigError on bad combinations."""
    device = _build(DeviceConfig, "device", **_given(ns, "device"))
    config = EngineConfig(device=device, parallel=build_parallel(ns))
    engine = _build(EngineArgs, "engine", plugin=getattr(ns, "plugin", None),
                    plugin_args=getattr(ns, "plugin_args", None) or {}, config=config)
    process = _build(WorkerSupervisorConfig, "process", **_given(ns, "process"))
    deployment = _build(DeploymentConfig, "deployment", process_config=process, **_given(ns, "deployment"))
    return engine, deployment


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}); e.g. '{{\"hidden\": 64}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}; e.g. '{{\"hidden\": 64}}'")
    return value


def _bounded_int(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside [{low}, {high}]")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phyai-ray", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"phyai-ray {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,serve}")
    plan = commands.add_parser("plan", help="print ranks, replicas, bundles and named groups; starts nothing")
    plan.add_argument("--plugin", default=None, help="also check that this plugin accepts the topology")
    add_config_flags(plan)
    serve = commands.add_parser("serve", help="serve a plugin over HTTP (JSON in and out)")
    serve.add_argument("plugin", help="registered plugin name or 'package.module:Entry'")
    serve.add_argument("--plugin-args", type=_json_object, default=None, help="JSON object passed to Entry.create")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)")
    serve.add_argument("--port", type=_bounded_int(1, 65535), default=8000, help="TCP port (default: 8000)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV}, else no key)")
    serve.add_argument("--max-body-bytes", type=_bounded_int(1, 2**40), default=DEFAULT_MAX_BODY_BYTES,
                       help=f"largest accepted request body (default: {DEFAULT_MAX_BODY_BYTES})")
    add_config_flags(serve)
    return parser


def plan_text(ns: argparse.Namespace) -> str:
    """The dry-run report of `phyai-ray plan`: no Ray import, nothing started."""
    engine, deployment = build_configs(ns)
    parallel, device = engine.config.parallel, engine.config.device
    ranks = parallel.infer_replica_world_size()
    mode = deployment.resolve_mode(ranks)
    target = device.resolve_target()  # auto asks torch whether this machine sees a GPU
    lines = [f"parallel: {parallel.describe()}", f"ranks per replica: {ranks}",
             f"replicas: {deployment.replica_count}", f"workers: {deployment.replica_count * ranks}",
             f"mode: {deployment.mode} -> {mode}", f"device: {device.target} -> {target} ({device.params_dtype})"]
    lines += _bundle_lines(deployment, ranks, mode, use_gpu=target == "cuda")
    if ns.plugin is not None:
        lines.append(_check_plugin(ns.plugin, parallel))
    return "\n".join(lines + _group_lines(parallel))


def _bundle_lines(deployment: DeploymentConfig, ranks: int, mode: str, use_gpu: bool) -> list[str]:
    from placement.bundles import describe_plan, plan_replicas

    if mode not in ("local", "cluster"):
        return [f"bundles: none ({mode} mode starts no placement groups)"]
    plans = plan_replicas(ranks_per_replica=ranks, replica_count=deployment.replica_count, use_gpu=use_gpu,
                          cpus_per_rank=deployment.cpus_per_rank, strategy=deployment.placement_strategy,
                          devices=deployment.devices)
    return ["bundles:"] + ["  " + line for line in describe_plan(plans).splitlines()]


def _check_plugin(spec: str, parallel: ParallelConfig) -> str:
    from phyai_ray.plugins.registry import resolve_plugin

    entry = resolve_plugin(spec)
    entry.check_parallel(parallel)
    return f"plugin: {entry.display_name()} accepts this topology"


def _group_lines(parallel: ParallelConfig) -> list[str]:
    """`output rank: N`, then one line per named group: `  dense_tp: [0,1] [2,3] ...`."""
    from placement.topology import GROUP_NAMES, Topology

    topology = Topology.from_parallel(parallel)
    lines = [f"output rank: {topology.output_rank}", "groups:"]
    for name in GROUP_NAMES:
        lines.append(f"  {name}: " + " ".join("[" + ",".join(map(str, g)) + "]" for g in topology.groups(name)))
    return lines


def _serve(ns: argparse.Namespace, engine: EngineArgs, deployment: DeploymentConfig) -> int:
    from phyai_ray.serve.app import run_server  # the HTTP stack loads only when serving
    run_server(engine, deployment, host=ns.host, port=ns.port, api_key=ns.api_key,
               max_body_bytes=ns.max_body_bytes)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `phyai-ray` console script; returns the exit status."""
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors (status 2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if ns.command == "plan":
            print(plan_text(ns))
            return 0
        engine, deployment = build_configs(ns)
        deployment.resolve_mode(engine.config.parallel.infer_replica_world_size())
    except (PhyAIError, ValueError) as exc:  # configuration problems only; serving errors propagate
        print(f"phyai-ray {ns.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    return _serve(ns, engine, deployment)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
