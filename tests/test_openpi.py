"""openpi's robot-policy WebSocket against a real Serve app: 2 groups x TP=2 of reference_policy (gloo, CPU).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_openpi.py -q

The robots run `openpi_client.WebsocketClientPolicy` from the package index, in a venv of its own
(openpi-client pins numpy < 2; tests/client_venv.py builds it), as threads of one process
(tests/scripts/openpi_robots.py). Actions must equal `Engine.step` of the example policy on one
inline rank (float32 rounding). A frame no real client would send (not msgpack) and a wrong key
are sent with the `websockets` library. The last test kills a rank: it runs last because the
group it breaks is replaced by Serve afterwards. Like test_serve_http.py, the module checks for
leaks itself after deleting its app from the session's Serve instance.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from typing import Any

import msgpack
import numpy as np
import pytest
import requests
import torch

from phyai_ray import DenseParallelConfig, DeploymentConfig, Engine, EngineArgs, EngineConfig, ParallelConfig
from phyai_ray.config.deployment import WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig
from tests.client_venv import REPO, client_python, run_client, run_script
from tests.conftest import delete_serve_apps, shared_serve, wait_for_no_leaks
from tests.tolerances import against

KEY = "robot-key-1"
APP = "openpi"
PLUGIN_ARGS = {"seed": 7, "state_dim": 8, "action_dim": 7, "horizon": 10}
NOTICE_S = 30.0  # a killed rank reaches the robot on its group as an error within this, from the kill


@pytest.fixture(scope="module")
def server() -> dict[str, Any]:
    from ray import serve

    from phyai_ray.serve import create_app

    client_python()  # build the clients' venv before the app holds the cluster
    port = shared_serve()["port"]
    args = EngineArgs(plugin="reference_policy", plugin_args=PLUGIN_ARGS, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    deployment = DeploymentConfig.local(replica_count=2, cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(
        startup_timeout_s=120, execution_timeout_s=20))
    try:
        serve.run(create_app(args, deployment, api_key=KEY), name=APP, route_prefix="/")
        yield {"port": port, "url": f"ws://127.0.0.1:{port}/v1/openpi", "http": f"http://127.0.0.1:{port}"}
    finally:
        delete_serve_apps()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


@pytest.fixture(scope="module")
def policy() -> Any:
    """The example policy on one inline rank: the reference for every action."""
    engine = Engine(EngineArgs(plugin="reference_policy", plugin_args=PLUGIN_ARGS,
                               config=EngineConfig(device=DeviceConfig(target="cpu"))))
    yield engine
    engine.close()


def check_actions(record: dict[str, Any], policy: Any) -> None:
    for step, (state, actions) in enumerate(zip(record["states"], record["actions"])):
        want = policy.step({"state": torch.tensor(state, dtype=torch.float32), "step": step})["actions"]
        np.testing.assert_allclose(np.array(actions, dtype=np.float32), want.numpy(), **against("flow_policy", "chunks"))


def test_openpi_client_runs_200_steps_of_the_example_policy(server: dict[str, Any], policy: Any) -> None:
    out = run_client("openpi_robots.py", server["url"], KEY, "1", "200", "0")
    robot = out["0"]
    assert robot["error"] is None
    assert robot["metadata"] == {"policy": "reference_policy", "state_dim": 8, "action_dim": 7,
                                 "action_horizon": 10, "seed": 7}
    actions = np.array(robot["actions"])
    assert actions.shape == (200, 10, 7) and np.abs(actions).max() < 0.999  # not saturated: the policy acts
    assert not np.array_equal(actions[0], actions[1])
    check_actions(robot, policy)
    assert robot["timing_keys"] == ["batch_size", "deadline_met", "deadline_ms", "forwarded", "group", "infer_ms",
                                   "queue_ms", "received_at", "request_id", "sent_at", "total_ms", "weight_version"]
    assert len(set(robot["groups"])) == 1  # one connection, one session, one group
    assert len(set(robot["ids"])) == 200


def test_four_robots_at_once_each_stay_on_one_group(server: dict[str, Any], policy: Any) -> None:
    out = run_client("openpi_robots.py", server["url"], KEY, "4", "60", "0.005")
    for robot in out.values():
        assert robot["error"] is None and len(robot["actions"]) == 60
        assert len(set(robot["groups"])) == 1, robot["groups"]
    per_group = Counter(r["groups"][0] for r in out.values())
    assert sorted(per_group.values()) == [2, 2], per_group  # the burst spreads evenly (the router reserves)
    check_actions(out["3"], policy)


def robots_while(server: dict[str, Any], robots: int, steps: int, pause_s: float, during: Any) -> tuple[Any, dict]:
    """`robots` openpi-client robots in a process of their own; `during()` runs once every robot has
    connected and acted; (what it returned, the robots' records)."""
    proc = subprocess.Popen([client_python(), str(REPO / "tests/scripts/openpi_robots.py"), server["url"], KEY,
                             str(robots), str(steps), str(pause_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        value = during()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, stderr[-3000:]
    return value, json.loads(stdout.strip().splitlines()[-1])


def test_eight_sessions_opened_at_once_stay_four_and_four_and_count_while_open(server: dict[str, Any]) -> None:
    seen, out = robots_while(server, 8, 100, 0.05, lambda: sessions_per_group(server, [4, 4]))
    assert seen == [4, 4], seen
    assert all(r["error"] is None and len(set(r["groups"])) == 1 for r in out.values())
    assert sorted(Counter(r["groups"][0] for r in out.values()).values()) == [4, 4]
    assert sessions_per_group(server, [0, 0]) == [0, 0]  # closed sessions stop counting


def sessions_per_group(server: dict[str, Any], want: list[int], within_s: float = 30.0) -> list[int]:
    """Open sessions per serving group once they read `want` (the registry's copy lags a report), or as last read."""
    seen, deadline = [], time.monotonic() + within_s
    while seen != want and time.monotonic() < deadline:
        seen = sorted(r["sessions"] for r in replicas(server) if r["state"] == "serving")
        time.sleep(0.1)
    return seen


def test_a_wrong_key_is_refused_and_a_bad_frame_gets_an_error_frame(server: dict[str, Any]) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    with pytest.raises(InvalidStatus) as info:
        connect(server["url"], additional_headers={"Authorization": "Api-Key wrong"}, open_timeout=30)
    assert info.value.response.status_code == 403
    headers = {"Authorization": f"Api-Key {KEY}", "X-Request-ID": "robot-7"}
    with connect(server["url"], additional_headers=headers, open_timeout=30) as ws:
        assert msgpack.unpackb(ws.recv(timeout=30))["policy"] == "reference_policy"
        ws.send(b"\xc1 not msgpack")
        assert "bad observation" in ws.recv(timeout=30)
        ws.send(msgpack.packb({"state": [0.0] * 3}))
        assert "'state' must hold 8 numbers" in ws.recv(timeout=30)
        ws.send(msgpack.packb({"state": [0.5] * 8}))  # the session goes on after errors
        reply = msgpack.unpackb(ws.recv(timeout=30))  # arrays stay in openpi's form: {b"__ndarray__", ...}
        assert reply["actions"][b"shape"] == [10, 7] and reply["actions"][b"dtype"] == "<f4"
        assert reply["server_timing"]["group"] in {r["group"] for r in replicas(server)}
        assert reply["server_timing"]["request_id"] == "robot-7-3"  # the session's id, then the frame's number


def test_the_example_robot_client_runs_as_written(server: dict[str, Any]) -> None:
    out = run_script(REPO / "examples" / "robot_client.py", "--url", server["url"], "--api-key", KEY, "--steps", "50")
    assert "'action_horizon': 10" in out and "50 steps on group(s) [" in out and "round trip p50" in out


def replicas(server: dict[str, Any]) -> list[dict[str, Any]]:
    return requests.get(f"{server['http']}/v1/replicas", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30).json()["replicas"]


def test_a_killed_rank_gives_its_robots_an_error_and_the_others_keep_acting(server: dict[str, Any]) -> None:
    def kill_a_rank() -> tuple[dict[str, Any], float]:
        victim = replicas(server)[0]
        killed_at = time.time()
        os.kill(victim["pids"][1], signal.SIGKILL)
        return victim, killed_at

    (victim, killed_at), out = robots_while(server, 4, 300, 0.02, kill_a_rank)
    hit = [r for r in out.values() if r["groups"] and r["groups"][0] == victim["group"]]
    spared = [r for r in out.values() if r not in hit]
    assert hit and spared, {k: r["groups"][:1] for k, r in out.items()}
    for robot in hit:
        assert robot["error"] is not None and "Error in inference server" in robot["error"], robot["error"]
        assert "could not act" in robot["error"]
        assert robot["error_at"] - killed_at < NOTICE_S
        assert set(robot["groups"]) == {victim["group"]}
    for robot in spared:
        assert robot["error"] is None and len(robot["actions"]) == 300
        assert len(set(robot["groups"])) == 1
