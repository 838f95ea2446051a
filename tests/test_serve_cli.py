"""`serve run` arguments and the `phyai-ray serve` command (a real server in a subprocess).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_serve_cli.py -q

The subprocess starts its own local Ray instance (`phyai_ray.raystart.ensure_ray`; RAY_ADDRESS is
removed from its environment); the test stops it with SIGTERM and checks that every process it
started is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from phyai_ray.errors import ParallelConfigError
from phyai_ray.serve.protocols import codec
from phyai_ray.serve.runtime.options import API_KEY_ENV, ServeOptions, app_arg_keys, parse_app_args
from tests.helpers import (REPO, console_script, free_port, kill_leftovers, post_step, stop_and_check, wait_for_log,
                           wait_ready, wait_until)
from tests.plugins.tiny import reference

PLUGIN = "tests.plugins.serve_plugins:ServeRowTPEntry"


def test_app_args_from_strings_build_the_engine_and_edge_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    engine, deployment, options = parse_app_args({
        "plugin": "reference_dit", "plugin_args": '{"hidden": 64}', "dense_tp_size": "2",
        "attention-tp-size": "2", "pp_size": "2", "replicas": "3", "device": "cpu", "devices": "0,1,2,3,4,5,6,7,8,9,10,11",
        "execution_timeout_s": "12.5", "api_key": "k", "max_body_bytes": "1000", "rebuild_failed": "true"})
    assert engine.plugin == "reference_dit" and engine.plugin_args == {"hidden": 64}
    parallel = engine.config.parallel
    assert (parallel.dense.tp_size, parallel.attention.tp_size, parallel.outer.pp_size) == (2, 2, 2)
    assert parallel.explicit_domains == {"dense", "attention"}  # moe stays inferred
    assert deployment.replica_count == 3 and deployment.devices == tuple(range(12))
    assert deployment.process_config.execution_timeout_s == 12.5 and engine.config.device.target == "cpu"
    assert options == ServeOptions(api_key="k", max_body_bytes=1000, rebuild_failed=True)


def test_app_args_accept_yaml_values_and_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    engine, deployment, options = parse_app_args({"plugin": "p", "plugin_args": {"a": [1, 2]}, "replicas": 2,
                                                  "devices": [0, 1], "health_check_period_s": 2})
    assert engine.plugin_args == {"a": [1, 2]} and deployment.devices == (0, 1) and deployment.replica_count == 2
    assert options.api_key == "from-env" and options.health_check_period_s == 2.0


@pytest.mark.parametrize("args,match", [
    ({"dense_tp_size": "2"}, "needs plugin="),
    ({"plugin": "p", "tp": "2"}, r"unknown build_app argument\(s\) \['tp'\]"),
    ({"plugin": "p", "plugin_args": "[1]"}, "must be a JSON object"),
    ({"plugin": "p", "plugin_args": "{bad"}, "must be a JSON object"),
    ({"plugin": "p", "devices": "0,x"}, "comma-separated integers"),
    ({"plugin": "p", "dense_tp_size": "two"}, "--dense-tp-size='two'"),
    ({"plugin": "p", "max_body_bytes": "0"}, "max_body_bytes"),
])
def test_bad_app_args_name_the_key(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_app_args(args)


def test_domain_mismatch_in_app_args_is_a_parallel_config_error() -> None:
    with pytest.raises(ParallelConfigError, match="same number of ranks"):
        parse_app_args({"plugin": "p", "dense_tp_size": "2", "attention_tp_size": "4"})


def test_every_cli_config_flag_is_an_app_arg() -> None:
    keys = app_arg_keys()
    assert {"dense_tp_size", "attention_cp_size", "moe_ep_size", "pp_size", "cfg_size", "replicas", "mode",
            "address", "devices", "device", "dtype", "execution_timeout_s", "startup_timeout_s"} <= set(keys)
    assert keys["replicas"] == ("deployment", "replica_count")


def test_build_app_binds_one_ingress_deployment() -> None:
    from ray.serve import Application

    from phyai_ray.serve import build_app

    app = build_app({"plugin": PLUGIN, "dense_tp_size": "2", "replicas": "2", "device": "cpu"})
    assert isinstance(app, Application)


def test_serve_never_imports_the_cli() -> None:
    """`cli` sits above `serve`: every serve module, and building an app's configs, leave it unloaded."""
    modules = sorted(".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                     for f in (REPO / "phyai_ray" / "serve").rglob("*.py"))
    code = ("import importlib, sys; from phyai_ray.serve.runtime.options import parse_app_args; "
            f"[importlib.import_module(m) for m in {modules!r}]; "
            "parse_app_args({'plugin': 'p', 'dense_tp_size': '2', 'replicas': '2'}); "
            "print('LOADED', 'phyai_ray.cli' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "LOADED False", done.stdout + done.stderr[-3000:]


class FakeRay:
    """Stands in for `ray.is_initialized` / `ray.init`, recording the calls."""

    def __init__(self, initialized: bool = False) -> None:
        self.initialized, self.calls = initialized, []

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, address: str | None = None, **kwargs: Any) -> None:
        self.calls.append((address, kwargs))
        self.initialized = True


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    import ray

    from phyai_ray import raystart

    fake = FakeRay()
    monkeypatch.setattr(ray, "is_initialized", fake.is_initialized)
    monkeypatch.setattr(ray, "init", fake.init)
    monkeypatch.setattr(raystart, "_running_local_instance", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return fake


def test_the_server_starts_a_local_ray_sized_to_the_plan(fake_ray: FakeRay) -> None:
    from phyai_ray.serve.runtime.server import _join_ray

    engine, deployment, _ = parse_app_args({"plugin": "p", "dense_tp_size": "2", "attention_tp_size": "2",
                                            "replicas": "2", "device": "cpu"})
    assert _join_ray(engine, deployment) is True  # started here: the server shuts it down on exit
    assert fake_ray.calls == [("local", {"num_cpus": max(os.cpu_count() or 1, 4), "include_dashboard": False})]
    assert _join_ray(engine, deployment) is False and len(fake_ray.calls) == 1  # already initialized: reused


@pytest.mark.parametrize("mode,env,running,expected", [
    ("cluster", None, None, "10.0.0.1:6379"),
    ("local", "10.0.0.2:6379", None, "10.0.0.2:6379"),
    ("local", None, "127.0.0.1:6380", "127.0.0.1:6380"),
])
def test_ensure_ray_joins_a_cluster_as_it_is(fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch, mode: str,
                                             env: str | None, running: str | None, expected: str) -> None:
    from phyai_ray import DeploymentConfig, raystart

    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    monkeypatch.setattr(raystart, "_running_local_instance", lambda: running)
    deployment = (DeploymentConfig.cluster(address="10.0.0.1:6379") if mode == "cluster"
                  else DeploymentConfig.local(replica_count=2))
    assert raystart.ensure_ray(mode, deployment, cpus_needed=64) is False
    assert fake_ray.calls == [(expected, {})]  # never num_cpus: a joined cluster is taken as it is


def start_server(tmp_path: Path, port: int, *flags: str) -> tuple[subprocess.Popen, Path]:
    """`phyai-ray serve` of the test plugin (inline, one rank) in its own session, logging to a file."""
    env = {**os.environ, "PYTHONPATH": str(REPO), API_KEY_ENV: "cli-key", "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([console_script("phyai-ray"), "serve", PLUGIN, "--device", "cpu", "--port", str(port), *flags], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


@pytest.mark.ray  # `phyai-ray serve` starts a Ray instance of its own
def test_serve_answers_on_the_proxy_and_each_groups_own_port_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """`phyai-ray serve --direct-ingress`: the proxy's port answers a request and refuses one without the
    key; the group's Serve replica answers on its own port (no proxy hop), with the same key check.
    /v1/replicas lists the group's own direct port (`direct_port`); another listener in Serve's port
    range is no group's and is not printed; once Serve has replaced the group (its replica killed), the
    route lists the new group's port, which answers, and the gone group's no more. SIGTERM then stops
    everything the server started, exit status 0. (Without `--direct-ingress`, the same start, requests
    and SIGTERM run in tests/test_serve_hf.py and tests/test_serve_openai.py.)"""
    import re
    import signal

    import requests

    stray = _listen_in_range(30040, 30064)  # the range a scan of Serve's ports would have taken it from
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, log = start_server(tmp_path, port, "--direct-ingress")
    started: set[int] = set()
    auth = {"Authorization": "Bearer cli-key"}

    def serving() -> list[dict]:
        try:
            rows = requests.get(f"{url}/v1/replicas", headers=auth, timeout=5).json()["replicas"]
        except (requests.RequestException, ValueError, KeyError):  # the proxy while no group is up
            return []
        return [r for r in rows if r["state"] == "serving" and r["direct_port"] is not None]

    def direct(row: dict) -> str:
        return f"http://{row['direct_host']}:{row['direct_port']}"

    def answers(where: str, x: torch.Tensor = torch.ones(1, 8)) -> bool:
        reply = post_step(where, {"x": x}, key="cli-key")
        return reply.status_code == 200 and torch.equal(codec.decode(reply.json()["result"])["y"], reference(x))

    try:
        wait_ready(proc, url, 150, log)
        wait_for_log(log, "direct port:", 60)
        printed = [int(p) for p in re.findall(r"direct port: http://127\.0\.0\.1:(\d+)", log.read_text())]
        first = wait_until(serving, 30, "the group to report its direct port")[0]
        assert printed == [first["direct_port"]] and stray.getsockname()[1] not in printed, (printed, first)
        assert first["direct_host"] == "127.0.0.1" and answers(direct(first))
        assert answers(url, torch.arange(8, dtype=torch.float32).reshape(1, 8))  # the proxy's port beside it
        assert post_step(url, {"x": [[1.0] * 8]}, timeout_s=10).status_code == 401
        assert post_step(direct(first), {"x": [[1.0] * 8]}, timeout_s=10).status_code == 401
        os.kill(first["replica_pid"], signal.SIGKILL)  # Serve replaces the group: a new replica, a new port
        second = wait_until(lambda: [r for r in serving() if r["group"] != first["group"]], 120,
                            "the replacement group to report its direct port")[0]
        assert answers(direct(second)), second
        rows = requests.get(f"{url}/v1/replicas", headers=auth, timeout=10).json()["replicas"]
        assert [r["direct_port"] for r in rows if r["group"] == first["group"] and r["state"] == "gone"] in ([], [None])
        wait_for_log(log, "phyai-ray: serving", 60)  # serve.run returned: the steady-state signal path
        stop_and_check(proc, started)
    finally:
        stray.close()
        _cleanup(proc, started, log)


def _listen_in_range(low: int, high: int) -> "socket.socket":
    """A listener of this test process on the first free port of low..high-1."""
    import socket

    for candidate in range(low, high):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", candidate))
        except OSError:
            sock.close()
            continue
        sock.listen()
        return sock
    raise AssertionError(f"no free port in {low}..{high - 1} for the stray listener")


@pytest.mark.ray  # `phyai-ray serve` starts a Ray instance of its own
def test_sigterm_while_the_app_starts_still_shuts_down_cleanly(tmp_path: Path) -> None:
    proc, log = start_server(tmp_path, free_port())
    started: set[int] = set()
    try:
        wait_for_log(log, "Started Serve", 120)  # Ray is up, serve.run is deploying the app
        stop_and_check(proc, started)
        assert "phyai-ray: serving" not in log.read_text()
    finally:
        _cleanup(proc, started, log)


def _cleanup(proc: subprocess.Popen, started: set[int], log: Path) -> None:
    """Kill what this test started and is still running (by pid), then show the log on failure."""
    kill_leftovers(proc, started)
    sys.stdout.write(log.read_text()[-5000:])  # shown by pytest when the test failed


def test_start_interruptible_gives_the_child_sigint_even_when_it_is_ignored_here() -> None:
    """A parent with SIGINT ignored (a background job of a non-interactive shell) passes that on to a
    plain child, so `serve run` would ignore Ctrl-C; `start_interruptible` restores the default."""
    show = "import signal; print('ignored' if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else 'handled')"
    parent = ("import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "from tests.helpers import start_interruptible; "
              f"plain = subprocess.run([sys.executable, '-c', {show!r}], capture_output=True, text=True); "
              f"child = start_interruptible([sys.executable, '-c', {show!r}], stdout=subprocess.PIPE, text=True); "
              "print(plain.stdout.strip(), '|', child.communicate(timeout=60)[0].strip())")
    done = subprocess.run([sys.executable, "-c", parent], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ignored | handled", done.stdout + done.stderr


def test_a_stopping_group_outlives_the_wait_of_a_request_it_forwarded() -> None:
    """Serve kills a stopping replica after graceful_shutdown_timeout_s; a request the failed group forwarded
    waits up to FORWARD_WAIT_S for a new group, and must get its answer (result or 503), not a dead replica's 500."""
    from phyai_ray.config.deployment import DeploymentConfig, WorkerSupervisorConfig
    from phyai_ray.serve.runtime.app import group_options
    from phyai_ray.serve.runtime.runner import FORWARD_WAIT_S

    engine, _, options = parse_app_args({"plugin": "p", "dense_tp_size": "2", "device": "cpu"})
    for shutdown_s in (1.0, 10.0, 60.0):
        deployment = DeploymentConfig.local(process_config=WorkerSupervisorConfig(shutdown_timeout_s=shutdown_s))
        graceful = group_options(engine, deployment, options)["graceful_shutdown_timeout_s"]
        assert graceful >= max(FORWARD_WAIT_S, shutdown_s) + 5, (shutdown_s, graceful)
