"""The `phyai-ray` command: plan a topology without starting anything, or serve a plugin over HTTP.

    phyai-ray --version
    phyai-ray plan --pp-size 4 --dense-tp-size 2          # 8 ranks: tp [0,1] [2,3] ..., pp [0,2,4,6] [1,3,5,7]
    phyai-ray serve reference_dit --dense-tp-size 2 --attention-tp-size 2 --replicas 2 --port 8000
    phyai-ray serve reference_policy --dense-tp-size 2 --replicas 2 --grpc-port 9000   # + OIP gRPC

The parallel-size and deadline flags are generated from the pydantic config models by
`phyai_ray.flags` (which `serve run phyai_ray.serve:build_app` uses too), so `--help` cannot
drift from the configs. `phyai-ray plan` imports neither Ray nor torch; `serve` loads the HTTP
stack and joins or starts Ray through `phyai_ray.raystart.ensure_ray`, like `Engine` does.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
from typing import Any, Sequence

from phyai_ray import __version__
from phyai_ray.config.deployment import DeploymentConfig
from phyai_ray.config.engine import EngineArgs
from phyai_ray.config.parallel import ParallelConfig
from phyai_ray.errors import PhyAIError
from phyai_ray.flags import ConfigFlagError, add_config_flags, build_configs
from phyai_ray.serve.runtime.options import (API_KEY_ENV, API_KEYS_ENV, DEFAULT_MAX_BODY_BYTES, OVERLOAD_STATUSES,
                                             ServeOptions)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}); e.g. '{{\"hidden\": 64}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}; e.g. '{{\"hidden\": 64}}'")
    return value


def _keys_file(path: str) -> dict[str, str]:
    """--api-keys-file: a JSON object {tenant: key} (the file, so keys stay out of the process list)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path!r} as JSON ({exc}); it holds "
                                         "{\"tenant\": \"key\", ...}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise argparse.ArgumentTypeError(f"{path!r} must hold a JSON object of tenant names to keys, e.g. "
                                         "{\"lab-a\": \"key-a\", \"lab-b\": \"key-b\"}")
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
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: 127.0.0.1, local only); any other needs --api-key or --insecure")
    serve.add_argument("--port", type=_bounded_int(1, 65535), default=8000, help="TCP port (default: 8000)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help=f"require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV}, else no key)")
    serve.add_argument("--api-keys-file", type=_keys_file, default=None, metavar="PATH",
                       help=f"a JSON file {{tenant: key}}: several callers, each a tenant that sees only its own "
                       f"video jobs (default: ${API_KEYS_ENV} as JSON, else none); --api-key is tenant 'default'")
    serve.add_argument("--insecure", action="store_true",
                       help="allow a non-loopback --host without an API key (anyone who reaches it may use it)")
    serve.add_argument("--max-body-bytes", type=_bounded_int(1, 2**40), default=DEFAULT_MAX_BODY_BYTES,
                       help=f"largest accepted request body (default: {DEFAULT_MAX_BODY_BYTES})")
    serve.add_argument("--model-name", default=None, help=ServeOptions.model_fields["model_name"].description)
    serve.add_argument("--stream-interval", type=_bounded_int(1, 1024), default=None,
                       help=ServeOptions.model_fields["stream_interval"].description + " (default: 1)")
    videos = ServeOptions.model_fields
    serve.add_argument("--video-dir", default=None, help=videos["video_dir"].description)
    serve.add_argument("--video-ttl-s", type=float, default=None, help=videos["video_ttl_s"].description)
    serve.add_argument("--video-max-bytes", type=_bounded_int(1, 2**50), default=None,
                       help=videos["video_max_bytes"].description)
    serve.add_argument("--video-crf", type=_bounded_int(0, 51), default=None, help=videos["video_crf"].description)
    overload = ServeOptions.model_fields["overload_status"]
    serve.add_argument("--overload-status", type=int, choices=OVERLOAD_STATUSES, default=overload.default,
                       help=f"{overload.description} (default: {overload.default})")
    scaling = serve.add_argument_group("autoscaling", "Serve adds and removes whole replica groups; giving any "
                                       "of these turns it on (otherwise --replicas groups run)")
    for name, kind in SCALING_FLAGS:
        field = ServeOptions.model_fields[name]
        scaling.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=field.description)
    protocols = serve.add_argument_group("protocols", "the protocols existing clients speak (README: Clients)")
    protocols.add_argument("--grpc-port", type=_bounded_int(1, 65535), default=None,
                           help=ServeOptions.model_fields["grpc_port"].description)
    protocols.add_argument("--no-oip-http", dest="oip_http", action="store_false",
                           help="do not serve the Open Inference Protocol over HTTP (/v2/...)")
    protocols.add_argument("--no-openpi", dest="openpi", action="store_false",
                           help="do not serve openpi's robot-policy WebSocket (/v1/openpi)")
    protocols.add_argument("--direct-ingress", action="store_true",
                           help="every replica group's Serve replica also listens on a port of its own (Ray Serve's "
                           "direct ingress; printed once serving): a robot's frames skip the proxy hop. Applies to the "
                           "Ray instance this command starts; a cluster must be started with "
                           "RAY_SERVE_ENABLE_DIRECT_INGRESS=1")
    add_config_flags(serve)
    return parser


SCALING_FLAGS = (("min_replicas", int), ("max_replicas", int), ("target_ongoing_requests", float))


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


def tenant_keys(ns: argparse.Namespace) -> dict[str, str] | None:
    """{tenant: key} from --api-keys-file, else from $PHYAI_RAY_API_KEYS (a JSON object), else None."""
    if ns.api_keys_file is not None:
        return ns.api_keys_file
    text = os.environ.get(API_KEYS_ENV)
    if not text:
        return None
    try:
        return _json_object(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigFlagError(f"${API_KEYS_ENV} {exc}; it holds {{\"tenant\": \"key\", ...}}") from None


def check_exposure(host: str, api_key: Any, insecure: bool) -> None:
    """Refuse to serve without a key on an address other machines can reach, unless told `insecure`."""
    if api_key or insecure or _is_loopback(host):
        return
    raise ConfigFlagError(f"--host {host} accepts connections from other machines, but no API key is set; pass "
                          f"--api-key KEY (or set {API_KEY_ENV}), or bind --host 127.0.0.1, or add --insecure to "
                          "serve without a key anyway")


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _serve(ns: argparse.Namespace, engine: EngineArgs, deployment: DeploymentConfig) -> int:
    from phyai_ray.serve.runtime.server import run_server  # Ray and the HTTP stack load only when serving
    keys = tenant_keys(ns)
    run_server(engine, deployment, host=ns.host, port=ns.port, api_key=ns.api_key,
               **({"api_keys": keys} if keys else {}),
               max_body_bytes=ns.max_body_bytes, overload_status=ns.overload_status,
               **({"direct_ingress": True} if ns.direct_ingress else {}),
               **{switch: False for switch in ("oip_http", "openpi") if not getattr(ns, switch)},
               **{name: getattr(ns, name) for name in ("model_name", "grpc_port", "stream_interval", "video_dir",
                                                       "video_ttl_s", "video_max_bytes", "video_crf",
                                                       *(n for n, _ in SCALING_FLAGS))
                  if getattr(ns, name) is not None})
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
        check_exposure(ns.host, ns.api_key or tenant_keys(ns), ns.insecure)
    except (PhyAIError, ValueError) as exc:  # configuration problems only; serving errors propagate
        print(f"phyai-ray {ns.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    return _serve(ns, engine, deployment)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
