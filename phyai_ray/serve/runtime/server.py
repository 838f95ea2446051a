"""`run_server`: what `phyai-ray serve` runs: join or start Ray, start Serve, deploy, wait for a signal.

    phyai-ray serve reference_dit --dense-tp-size 2 --replicas 2 --device cpu --port 8000
    # Ctrl-C (SIGINT) or SIGTERM: the app, Serve and (if this process started it) Ray shut down

Ray is joined or started by `phyai_ray.raystart.ensure_ray`, as `Engine` does: the running
instance, the cluster (cluster mode, RAY_ADDRESS, a `ray start` on this machine), else a local
instance with at least as many CPUs as the plan reserves (2 groups x TP=2 -> 4, even on a
2-core machine; with autoscaling, max_replicas groups). Serve's HTTP proxy binds `host` (127.0.0.1 unless told otherwise) and `port`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from phyai_ray.config.deployment import DeploymentConfig
from phyai_ray.config.engine import EngineArgs
from phyai_ray.raystart import ensure_ray, plan_cpus
from phyai_ray.serve.runtime.direct import DIRECT_INGRESS_ENV
from phyai_ray.serve.runtime.options import DEFAULT_MAX_BODY_BYTES, ServeOptions

logger = logging.getLogger(__name__)

APP_NAME = "phyai"


class _StopWhileStarting(Exception):
    """SIGINT/SIGTERM arrived before the app was up; unwinds the start, then shuts down."""


@dataclass
class Server:
    """A running Serve app. `shutdown()` deletes the app; when this process started Ray, it also stops
    Serve and Ray (on a shared cluster, Serve and other apps keep running)."""

    url: str
    owns_ray: bool
    serving: bool = False
    _stopped: threading.Event = field(default_factory=threading.Event)

    def handle_signals(self) -> None:
        """Turn SIGINT/SIGTERM into a clean stop (after ray.init, which sets its own SIGTERM handler)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stopped.set()
        if not self.serving:
            raise _StopWhileStarting(signal.Signals(signum).name)

    def wait(self) -> None:
        """Block until SIGINT or SIGTERM."""
        while not self._stopped.wait(0.5):
            pass

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            if self.owns_ray:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            if self.owns_ray and ray.is_initialized():
                ray.shutdown()
        logger.info("phyai-ray: server at %s stopped", self.url)


def run_server(engine_args: EngineArgs, deployment: DeploymentConfig | None = None, *, host: str = "127.0.0.1",
               port: int = 8000, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               blocking: bool = True, direct_ingress: bool = False, **option_values: Any) -> Server | None:
    """Serve `engine_args` at http://host:port; block until a signal unless `blocking=False`.

    `option_values` are further `ServeOptions` fields (rebuild_failed=..., health_check_period_s=...).
    With `blocking=False` the running `Server` is returned; call its `shutdown()`.
    `direct_ingress`: every group's Serve replica also listens on a port of its own (Ray Serve's
    direct ingress, RAY_SERVE_ENABLE_DIRECT_INGRESS=1, set for the Ray instance started here), so a
    robot's frames skip the proxy; the groups' own ports are printed once serving (`direct_ports`) and
    listed by `/v1/replicas`, a replaced group's new port too.
    """
    from phyai_ray.serve.runtime.app import create_app

    if blocking and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_server(blocking=True) waits for SIGINT/SIGTERM and must run on the main thread; "
                           "pass blocking=False and call server.shutdown() yourself")
    deployment = deployment or DeploymentConfig()
    options = ServeOptions(api_key=api_key, max_body_bytes=max_body_bytes, **option_values)
    if direct_ingress:
        os.environ[DIRECT_INGRESS_ENV] = "1"  # read by Serve's controller and replicas: before Ray starts
        # Serve holds a stopping direct-ingress replica open 30 s so a load balancer can deregister it;
        # no balancer stands in front of this command's ports, so a stop takes 2 s unless set otherwise
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
    server = Server(url=f"http://{host}:{port}", owns_ray=_join_ray(engine_args, deployment, options.max_replicas))
    if blocking:
        server.handle_signals()
    try:
        app = create_app(engine_args, deployment, options)
        _deploy(app, host, port, options.grpc_port)
    except _StopWhileStarting:
        server.shutdown()
        return None
    except BaseException:
        server.shutdown()
        raise
    server.serving = True
    print(f"phyai-ray: serving {engine_args.plugin} at {server.url} (docs: {server.url}/docs)", flush=True)
    if options.grpc_port is not None:
        print(f"phyai-ray: Open Inference Protocol gRPC at {host}:{options.grpc_port}", flush=True)
    if direct_ingress:
        for direct in direct_ports(APP_NAME):
            print(f"phyai-ray: a replica group's direct port: http://{host}:{direct} (ws://{host}:{direct}/v1/openpi)",
                  flush=True)
    if not blocking:
        return server
    try:
        server.wait()
    finally:
        server.shutdown()
    return None


def _deploy(app: Any, host: str, port: int, grpc_port: int | None = None) -> None:
    """Start Serve's proxy on host:port (and its gRPC proxy on grpc_port) and run the app; returns once ready."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, grpc_options=grpc_options(grpc_port))
    serve.run(app, name=APP_NAME, route_prefix="/")


def direct_ports(app_name: str = APP_NAME, timeout_s: float = 30.0) -> list[int]:
    """The direct ports of the app's groups, from its registry (the driver's view of `/v1/replicas`):
    once every group that is not gone has reported one, or what is known after `timeout_s`."""
    from ray import serve

    from phyai_ray.serve.runtime.app import REGISTRY_NAME

    registry = serve.get_deployment_handle(REGISTRY_NAME, app_name=app_name)
    deadline = time.monotonic() + timeout_s
    while True:
        groups = [r for r in registry.snapshot.remote().result(timeout_s=max(timeout_s, 5.0)) if r.state != "gone"]
        ports = [r.direct_port for r in sorted(groups, key=lambda r: r.group) if r.direct_port is not None]
        if (groups and len(ports) == len(groups)) or time.monotonic() > deadline:
            return ports
        time.sleep(0.25)


def grpc_options(port: int | None) -> dict[str, Any] | None:
    """Serve's gRPC proxy options that serve the Open Inference Protocol's gRPC service on `port`."""
    from phyai_ray.serve.protocols.oip.servicer import SERVICER_FUNCTION

    return None if port is None else {"port": port, "grpc_servicer_functions": [SERVICER_FUNCTION]}


def _join_ray(engine_args: EngineArgs, deployment: DeploymentConfig, max_groups: int | None = None) -> bool:
    """Join or start Ray as `Engine` does (a local instance sized to the plan); True when started here."""
    mode = deployment.resolve_mode(engine_args.config.parallel.infer_replica_world_size())
    cpus = plan_cpus(engine_args, deployment) * max(1, (max_groups or 0) / deployment.replica_count)
    return ensure_ray(mode, deployment, cpus)
