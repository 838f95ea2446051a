"""A real `ray start --head` cluster: `ray job submit` of the examples, and `serve run` of a config file.

Run: flock /tmp/phyai-ray-test.lock .venv/bin/pytest tests/test_job_submit.py -q

The head runs as `ray start --head --block` in its own session, with its own temp dir and ports,
so it shares nothing with the test session's Ray. It is stopped by signalling that session's
process group (never `ray stop`, which would stop every Ray instance on the machine), and every
process it started must be gone afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests
import torch

from phyai_ray.serve import codec
from tests.plugins.tiny import reference
from tests.test_serve_cli import alive, descendants, free_port, wait_ready

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


class Head:
    """A `ray start --head --block` process and the addresses of its GCS and job API."""

    def __init__(self, tmp: str) -> None:
        self.gcs, self.dashboard = free_port(), free_port()
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_DEDUP_LOGS": "0",
                    "RAY_AUTH_MODE": "token"}  # explicit, so `ray job submit` sends the token (~/.ray/auth_token) too
        self.env.pop("RAY_ADDRESS", None)
        ports = {"--port": self.gcs, "--dashboard-port": self.dashboard, "--ray-client-server-port": free_port(),
                 "--node-manager-port": free_port(), "--object-manager-port": free_port(),
                 "--metrics-export-port": free_port(), "--dashboard-agent-listen-port": free_port(),
                 "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port()}
        cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--temp-dir={tmp}", "--num-cpus=4",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
               *[f"{flag}={port}" for flag, port in ports.items()]]
        self.log = open(Path(tmp) / "head.log", "w+")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started: set[int] = set()

    @property
    def job_address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ray start exited: {self.tail()}"
            try:
                reply = requests.get(f"{self.job_address}/api/version", timeout=2)
                if reply.status_code in (200, 401, 403):  # up (401/403: Ray's token auth is on)
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the head's job API did not come up in {timeout_s}s: {self.tail()}")

    def stop(self) -> None:
        """SIGTERM the head's process group, then SIGKILL whatever of it is left (by pid)."""
        self.started |= descendants(self.proc.pid)
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and (self.proc.poll() is None or self.live()):
                time.sleep(0.25)
        for pid in self.live():  # escaped the group
            os.kill(pid, signal.SIGKILL)
        self.log.close()

    def live(self) -> list[int]:
        return [p for p in self.started if alive(p)]

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    tmp = tempfile.mkdtemp(prefix="phyai-rs-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cluster = Head(tmp)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()
        leftovers = cluster.live()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not leftovers, f"processes of the test head survived: {leftovers}"


def submit(head: Head, *script: str, timeout_s: float = 240) -> str:
    done = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", head.job_address, "--working-dir", ".",
                           "--", "python", *script], cwd=REPO, env=head.env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"job failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_job_runs_two_replica_groups_on_the_cluster(head: Head) -> None:
    out = submit(head, "examples/job_step.py", "--tp", "2", "--replicas", "2")
    assert "job_step: 4 requests on 2 replica(s) x tp=2" in out and "(OK)" in out, out[-3000:]
    served = [int(line.split("served ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("replica ")]
    assert len(served) == 2 and sum(served) == 4, served


def test_serve_run_of_a_config_file_serves_build_app(head: Head, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"""\
http_options: {{host: 127.0.0.1, port: {port}}}
applications:
  - name: phyai-config
    route_prefix: /
    import_path: phyai_ray.serve:build_app
    runtime_env: {{env_vars: {{PYTHONPATH: "{REPO}"}}}}
    args: {{plugin: "tests.plugins.serve_plugins:ServeRowTPEntry", dense_tp_size: "2", device: cpu,
            api_key: config-key, execution_timeout_s: 60}}
""")
    log = (tmp_path / "serve-run.log").open("w+")
    proc = subprocess.Popen([str(BIN / "serve"), "run", str(config), "--address", f"127.0.0.1:{head.gcs}"],
                            cwd=REPO, env=head.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.stdout = log
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", 150)
        x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
        reply = requests.post(f"http://127.0.0.1:{port}/v1/step", json={"x": codec.encode(x)},
                              headers={"Authorization": "Bearer config-key"}, timeout=60)
        assert reply.status_code == 200, reply.text
        result = codec.decode(reply.json()["result"])
        assert result["tp"] == 2 and torch.equal(result["y"], reference(x))
        proc.send_signal(signal.SIGINT)  # serve run: Ctrl-C deletes the app and shuts Serve down
        proc.wait(timeout=90)
    except BaseException:
        log.seek(0)
        print(log.read()[-6000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def test_job_deploys_the_http_app(head: Head) -> None:  # after `serve run`: this job starts Serve on its port
    out = submit(head, "examples/serve_deploy.py", "--port", str(free_port()))
    assert "serve_deploy: POST" in out and "logits [1, 4, 128]" in out and "healthy: [True]" in out, out[-3000:]
