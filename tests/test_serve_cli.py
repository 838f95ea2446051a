"""`serve run` arguments and the `phyai-ray serve` command (a real server in a subprocess).

Run: flock /tmp/phyai-ray-test.lock .venv/bin/pytest tests/test_serve_cli.py -q

The subprocess starts its own, separate local Ray instance (`ray.init(address="local")`); the
test stops it with SIGTERM and checks that every process it started is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from phyai_ray.errors import ParallelConfigError
from phyai_ray.serve import codec
from phyai_ray.serve.options import API_KEY_ENV, ServeOptions, app_arg_keys, parse_app_args
from tests.plugins.tiny import reference

REPO = Path(__file__).resolve().parents[1]
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
    modules = sorted(f"phyai_ray.serve.{f.stem}" for f in (REPO / "phyai_ray" / "serve").glob("*.py"))
    code = ("import importlib, sys; from phyai_ray.serve.options import parse_app_args; "
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
    from phyai_ray.serve.server import _join_ray

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"phyai-ray serve exited early ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            if requests.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except requests.RequestException:  # not listening yet, or the proxy waits for the replica
            pass
        time.sleep(0.5)
    raise AssertionError(f"phyai-ray serve did not become ready at {url} within {timeout_s}s")


def start_server(tmp_path: Path, port: int) -> tuple[subprocess.Popen, Any]:
    """`phyai-ray serve` of the test plugin (inline, one rank) in its own session, logging to a file."""
    script = shutil.which("phyai-ray", path=str(Path(sys.executable).parent))
    assert script is not None, "the phyai-ray console script is not installed in this venv (pip install -e .)"
    env = {**os.environ, "PYTHONPATH": str(REPO), API_KEY_ENV: "cli-key", "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([script, "serve", PLUGIN, "--device", "cpu", "--port", str(port)], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.stdout = log
    return proc, log


def wait_for_log(log: Any, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in Path(log.name).read_text():
        assert time.monotonic() < deadline, f"{text!r} did not appear in the server log within {timeout_s}s"
        time.sleep(0.2)


def stop_and_check(proc: subprocess.Popen, started: set[int]) -> None:
    """SIGTERM: exit status 0, and every process the server started is gone within 30 s."""
    started |= descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    deadline = time.monotonic() + 30
    while any(alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in started if alive(p)], "the server's Ray processes outlived it"


def test_phyai_ray_serve_answers_a_request_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    proc, log = start_server(tmp_path, port)
    started: set[int] = set()
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", 150)
        x = torch.arange(8, dtype=torch.float32).reshape(1, 8)
        reply = requests.post(f"http://127.0.0.1:{port}/v1/step", json={"x": codec.encode(x)},
                              headers={"Authorization": "Bearer cli-key"}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert torch.equal(codec.decode(reply.json()["result"])["y"], reference(x))
        assert requests.post(f"http://127.0.0.1:{port}/v1/step", json={"x": [[1.0] * 8]}, timeout=10).status_code == 401
        wait_for_log(log, "phyai-ray: serving", 60)  # serve.run returned: the steady-state signal path
        stop_and_check(proc, started)
    finally:
        _cleanup(proc, started, log)


def test_sigterm_while_the_app_starts_still_shuts_down_cleanly(tmp_path: Path) -> None:
    proc, log = start_server(tmp_path, free_port())
    started: set[int] = set()
    try:
        wait_for_log(log, "Started Serve", 120)  # Ray is up, serve.run is deploying the app
        stop_and_check(proc, started)
        assert "phyai-ray: serving" not in Path(log.name).read_text()
    finally:
        _cleanup(proc, started, log)


def _cleanup(proc: subprocess.Popen, started: set[int], log) -> None:
    """Kill what this test started and is still running (by pid), then show the log on failure."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    for pid in started | descendants(proc.pid):
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log.seek(0)
    sys.stdout.write(log.read()[-5000:])  # shown by pytest when the test failed
    log.close()


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
