"""A real `ray start --head` cluster: `ray job submit` of the examples, and `serve run` of a config file.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_job_submit.py -q

The head runs as `ray start --head --block` in its own session, with its own temp dir and ports,
so it shares nothing with the test session's Ray. It is stopped by signalling that session's
process group (never `ray stop`, which would stop every Ray instance on the machine), and every
process it started must be gone afterwards.

Every test removes what it started on the head, pass or fail: a job that is still running is
stopped (`ray job stop`), and Serve with every app on the head is shut down through the head's
dashboard (`serve_on_head` fixture), so no test depends on what an earlier one left behind.

`serve run` is started with SIGINT at its default disposition (`start_interruptible`): launched
from a background job of a non-interactive shell, pytest and all its children inherit SIGINT
*ignored*, so `serve run` would never see the Ctrl-C that makes it delete its app.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import requests
import torch

from phyai_ray.serve.protocols import codec
from tests.helpers import (BIN, REPO, alive, descendants, free_port, kill_leftovers, post_step, start_interruptible,
                           stop_and_check, wait_ready, wait_until)
from tests.plugins.tiny import reference

pytestmark = pytest.mark.slow

# Prints the names of the Serve apps on the head whose dashboard is argv[1]; with argv[2] ==
# "shutdown" it first shuts Serve down there (apps, proxies, controller), as `serve shutdown -y` does.
_SERVE_ADMIN = """\
import json, sys
from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
client = ServeSubmissionClient(sys.argv[1])
if sys.argv[2] == "shutdown" and client.get_serve_details().get("controller_info", {}).get("node_id"):
    client.delete_applications()
print(json.dumps(sorted(client.get_serve_details().get("applications") or {})))
"""


class Head:
    """A `ray start --head --block` process and the addresses of its GCS and job API."""

    def __init__(self, tmp: str) -> None:
        self.gcs, self.dashboard = free_port(), free_port()
        # Token auth with a token of this head's own: every process below (the head, `ray job submit`,
        # `serve run`, jobs and replicas) reads it from the environment, nothing from ~/.ray.
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_DEDUP_LOGS": "0",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
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
        def up() -> bool:
            assert self.proc.poll() is None, f"ray start exited: {self.tail()}"
            try:  # 401/403: up, with Ray's token auth on
                return requests.get(f"{self.job_address}/api/version", timeout=2).status_code in (200, 401, 403)
            except requests.RequestException:
                return False

        wait_until(up, timeout_s, f"the head's job API at {self.job_address}", interval_s=0.5)

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


def serve_admin(head: Head, action: str = "status", timeout_s: float = 120) -> list[str]:
    """Names of the Serve apps on `head`, after shutting Serve down there when `action` is "shutdown"."""
    done = subprocess.run([str(BIN / "python"), "-c", _SERVE_ADMIN, head.job_address, action], env=head.env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"serve {action} on the test head failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def serve_on_head(head: Head) -> Iterator[Head]:
    """The head; afterwards (pass or fail) Serve and every app on it are shut down, and none may remain."""
    yield head
    assert serve_admin(head, "shutdown") == [], "Serve apps survived `serve shutdown` on the test head"


def submit(head: Head, *script: str, timeout_s: float = 240) -> str:
    """`ray job submit` of `python script...`; a job that failed or ran out of time is stopped."""
    job_id = f"phyai-test-{uuid.uuid4().hex[:12]}"
    cmd = [str(BIN / "ray"), "job", "submit", "--address", head.job_address, "--submission-id", job_id,
           "--working-dir", ".", "--", "python", *script]
    done = None
    try:
        done = subprocess.run(cmd, cwd=REPO, env=head.env, capture_output=True, text=True, timeout=timeout_s)
    finally:
        if done is None or done.returncode != 0:  # timed out, interrupted or failed: make sure it stops
            subprocess.run([str(BIN / "ray"), "job", "stop", "--address", head.job_address, job_id], cwd=REPO,
                           env=head.env, capture_output=True, timeout=120)
    assert done.returncode == 0, f"job failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_job_runs_two_replica_groups_on_the_cluster(head: Head) -> None:
    out = submit(head, "examples/job_step.py", "--tp", "2", "--replicas", "2")
    assert "job_step: 4 requests on 2 replica(s) x tp=2" in out and "(OK)" in out, out[-3000:]
    served = [int(line.split("served ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("replica ")]
    assert len(served) == 2 and sum(served) == 4, served


def test_job_runs_the_rl_loop(head: Head) -> None:
    out = submit(head, "examples/rl_loop.py", "--iterations", "3")
    assert "rl_loop: 3 iterations" in out and "pushed version 3 to ['SERVING', 'SERVING']" in out, out[-3000:]


def test_serve_run_of_a_config_file_serves_build_app(serve_on_head: Head, tmp_path: Path) -> None:
    head, port = serve_on_head, free_port()
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
    log = tmp_path / "serve-run.log"
    with log.open("w") as out:
        proc = start_interruptible([str(BIN / "serve"), "run", str(config), "--address", f"127.0.0.1:{head.gcs}"],
                                   cwd=REPO, env=head.env, stdout=out, stderr=subprocess.STDOUT)
    started: set[int] = set()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, 150, log)
        x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
        reply = post_step(url, {"x": x}, key="config-key")
        assert reply.status_code == 200, reply.text
        result = codec.decode(reply.json()["result"])
        assert result["tp"] == 2 and torch.equal(result["y"], reference(x))
        stop_and_check(proc, started, signal.SIGINT)  # serve run: Ctrl-C shuts Serve down, then exits 0
        assert serve_admin(head) == [], "serve run exited but left its app deployed"
    except BaseException:
        print(log.read_text()[-6000:])
        raise
    finally:
        kill_leftovers(proc, started)


def test_job_deploys_the_http_app(serve_on_head: Head) -> None:
    out = submit(serve_on_head, "examples/serve_deploy.py", "--port", str(free_port()))
    assert "serve_deploy: POST" in out and "logits [1, 4, 128]" in out and "healthy: [True]" in out, out[-3000:]
    assert serve_admin(serve_on_head) == [], "the job did not delete its app"
