"""openpi-client robots on a real Serve app of `reference_flow_policy` (one group, TP=1).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_openpi_fleet.py -q

The robots run `openpi_client` from the package index in the clients' venv (tests/client_venv.py):
deadline_ms in the connection's query, RTC fields every frame, the `server_timing` fields
(queue_ms, infer_ms, batch_size, deadline_ms, deadline_met), frames of different robots sharing
denoising steps; a frame that cannot meet its deadline and a bad RTC frame get error frames and
the session goes on; /metrics counts the missed deadlines. OIP and the JSON route take a deadline
too, and examples/robot_fleet.py runs against the same app.
"""

from __future__ import annotations

import json
import re

import pytest
import requests

from phyai_ray import DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig, WorkerSupervisorConfig
from tests.client_venv import REPO, client_python, run_client, run_script
from tests.conftest import closed_without_leaks, delete_serve_apps, shared_serve
from tests.test_flow_policy import ARGS

KEY = "fleet-key"
CPU = DeviceConfig(target="cpu")


@pytest.fixture(scope="module")
def fleet_server():
    from ray import serve

    from phyai_ray.serve import create_app

    client_python()
    port = shared_serve()["port"]
    args = EngineArgs(plugin="reference_flow_policy", plugin_args=ARGS, config=EngineConfig(device=CPU))
    deployment = DeploymentConfig.local(replica_count=1, cpus_per_rank=0.5,
                                        process_config=WorkerSupervisorConfig(execution_timeout_s=30))
    serve.run(create_app(args, deployment, api_key=KEY), name="fleet", route_prefix="/")
    yield from closed_without_leaks({"url": f"ws://127.0.0.1:{port}/v1/openpi", "http": f"http://127.0.0.1:{port}"},
                                    delete_serve_apps)


def test_openpi_robots_with_rtc_and_deadlines_read_the_timing_of_every_frame(fleet_server):
    out = run_client("flow_robots.py", fleet_server["url"] + "?deadline_ms=5000", KEY, "6", "12", timeout_s=300)
    sizes = []
    for robot in out.values():
        assert robot["error"] is None, robot["error"]
        assert robot["metadata"]["num_steps"] == 10 and robot["metadata"]["action_horizon"] == 16
        assert len(robot["timing"]) == 12 and all(robot["prefix_exact"])
        for timing in robot["timing"]:
            assert timing["deadline_ms"] == 5000 and timing["deadline_met"] is True
            assert timing["queue_ms"] >= 0 and timing["infer_ms"] > 0 and timing["batch_size"] >= 1
            assert timing["total_ms"] >= timing["infer_ms"]
            sizes.append(timing["batch_size"])
        assert "deadline_missed" in robot["late"], robot["late"]
        assert "bad observation" in robot["bad_rtc"] and "inference_delay" in robot["bad_rtc"], robot["bad_rtc"]
        assert robot["after"] == "ok"
    assert max(sizes) > 1, sizes  # robots' frames shared denoising steps
    metrics = requests.get(fleet_server["http"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                           timeout=10).text
    missed = re.search(r'phyai_request_deadlines_total\{outcome="missed"\} (\S+)', metrics)
    met = re.search(r'phyai_request_deadlines_total\{outcome="met"\} (\S+)', metrics)
    assert missed and float(missed.group(1)) >= 6 and met and float(met.group(1)) >= 72, metrics[-2000:]
    assert "phyai_request_infer_seconds_bucket" in metrics and "phyai_request_batch_size_bucket" in metrics


def test_a_bad_deadline_in_the_query_closes_the_connection_with_the_reason(fleet_server):
    import websockets.sync.client as ws
    from websockets.exceptions import ConnectionClosed

    with ws.connect(fleet_server["url"] + "?deadline_ms=-5",
                    additional_headers={"Authorization": f"Api-Key {KEY}"}) as conn:
        with pytest.raises(ConnectionClosed) as closed:
            conn.recv(timeout=10)
    assert closed.value.rcvd.code == 1008 and "deadline_ms" in closed.value.rcvd.reason


def test_http_and_oip_take_a_deadline_and_report_the_timing(fleet_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"inputs": [{"name": "state", "datatype": "FP32", "shape": [8], "data": [0.1] * 8}],
            "parameters": {"deadline_ms": 4000}}
    reply = requests.post(fleet_server["http"] + "/v2/models/reference_flow_policy/infer", json=body,
                          headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    params = reply.json()["parameters"]
    assert params["deadline_ms"] == 4000 and params["deadline_met"] is True and params["batch_size"] >= 1
    late = requests.post(fleet_server["http"] + "/v2/models/reference_flow_policy/infer",
                         json={**body, "parameters": {"deadline_ms": 0.001}}, headers=headers, timeout=30)
    assert late.status_code == 504 and "deadline" in late.text
    bad = requests.post(fleet_server["http"] + "/v2/models/reference_flow_policy/infer",
                        json={**body, "parameters": {"deadline_ms": "soon"}}, headers=headers, timeout=30)
    assert bad.status_code == 400 and "parameters.deadline_ms" in bad.text
    step = requests.post(fleet_server["http"] + "/v1/step", json={"state": [0.1] * 8},
                         headers={**headers, "X-Request-Deadline-Ms": "3000"}, timeout=30)
    assert step.status_code == 200 and "deadline;desc=met" in step.headers["server-timing"]
    bad_header = requests.post(fleet_server["http"] + "/v1/step", json={"state": [0.1] * 8},
                               headers={**headers, "X-Request-Deadline-Ms": "0"}, timeout=30)
    assert bad_header.status_code == 400 and "X-Request-Deadline-Ms" in bad_header.text


def test_the_robot_fleet_example_acts_on_time_with_exact_frozen_prefixes(fleet_server):
    out = run_script(REPO / "examples" / "robot_fleet.py", "--url", fleet_server["url"], "--api-key", KEY,
                     "--robots", "3", "--hz", "20", "--seconds", "3", "--late", "finish", timeout_s=240)
    totals = json.loads(out.splitlines()[-1])
    assert totals["robots"] == 3 and totals["frames"] >= 3 * 4 and totals["prefix_exact"] is True
    assert totals["errors"] == 0 and totals["on_time_fraction"] >= 0.9, out
    assert totals["stale_discarded"] <= totals["frames"] // 10, out  # late chunks came, and were not executed
    assert totals["idle_fraction"] < 0.1, out  # chunks arrive before the queues run dry
