"""The Serve app over real HTTP: 2 replica groups x TP=2 of `serve_row_tp` (gloo on CPU).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_serve_http.py -q

One Serve app serves the whole module (starting it costs most of the runtime). The tests run in
file order and the later ones break replica groups on purpose: a killed rank takes down group A
while group B serves (and the ingress restarts A in place, `rebuild_failed`); two requests past
`execution_timeout_s` take down both groups (504 each); with no group up requests get 503 until
the ingress has restarted them.
The module neither uses `ray_session` nor the `ray` marker: conftest's per-test leak check would
see the app's live rank actors and placement groups between tests. It checks for leaks itself,
once, after `serve.shutdown()`.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
import torch

from phyai_ray import DenseParallelConfig, DeploymentConfig, EngineArgs, EngineConfig, ParallelConfig
from phyai_ray.config.deployment import WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.errors import EngineUnavailableError
from phyai_ray.serve import codec
from phyai_ray.serve.holder import EngineHolder
from tests.conftest import RAY_CPUS, wait_for_no_leaks
from tests.helpers import free_port, post_step, wait_until
from tests.plugins.tiny import reference

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
EXECUTION_TIMEOUT_S = 4.0
PLUGIN = "tests.plugins.serve_plugins:ServeRowTPEntry"


@pytest.fixture(scope="module")
def url() -> str:
    import ray
    from ray import serve

    from phyai_ray.serve import create_app

    if not ray.is_initialized():  # the same instance `ray_session` would start; it reuses this one
        ray.init(num_cpus=RAY_CPUS, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = EngineArgs(plugin=PLUGIN, config=EngineConfig(device=DeviceConfig(target="cpu"),
                                                        parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    deployment = DeploymentConfig.local(replica_count=2, process_config=WorkerSupervisorConfig(
        execution_timeout_s=EXECUTION_TIMEOUT_S, startup_timeout_s=120))
    try:
        serve.run(create_app(args, deployment, api_key=KEY, max_body_bytes=MAX_BODY, rebuild_failed=True,
                             health_check_period_s=1.0), name="phyai", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


def step(url: str, x: torch.Tensor, **extra: Any) -> requests.Response:
    return post_step(url, {"x": x}, key=KEY, **extra)


def assert_good_step(url: str) -> None:
    x = torch.randint(-5, 5, (3, 8)).float()
    reply = step(url, x)
    assert reply.status_code == 200, reply.text
    result = codec.decode(reply.json()["result"])
    assert result["tp"] == 2 and torch.equal(result["y"], reference(x))


def error_of(reply: requests.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"} and {"type", "message"} <= set(body["error"]), body
    return body["error"]


def test_step_round_trips_tensors_over_both_replicas(url: str) -> None:
    for dtype in (torch.float32, torch.float64, torch.int64):
        x = torch.arange(16, dtype=dtype).reshape(2, 8) - 7
        reply = step(url, x)
        assert reply.status_code == 200, reply.text
        y = codec.decode(reply.json()["result"])["y"]
        assert y.dtype == torch.float32 and torch.equal(y, reference(x))
    plain = requests.post(f"{url}/v1/step", json={"x": [[1.0] * 8]}, headers=AUTH, timeout=60)
    assert codec.decode(plain.json()["result"])["y"].tolist() == reference([[1.0] * 8]).tolist()
    served = [r["served"] for r in requests.get(f"{url}/v1/replicas", headers=AUTH, timeout=10).json()["replicas"]]
    assert sum(served) >= 4 and all(s >= 1 for s in served), served  # fewest-in-flight with fair ties


JSON = {**AUTH, "Content-Type": "application/json"}
BAD_REQUESTS = {
    "no key": (401, "unauthorized", dict(json={"x": [[1.0] * 8]})),
    "wrong key": (401, "unauthorized", dict(json={"x": [[1.0] * 8]}, headers={"Authorization": "Bearer nope"})),
    "declared too large": (413, "payload_too_large", dict(data=b"[" + b"1," * MAX_BODY + b"1]", headers=JSON)),
    "chunked too large": (413, "payload_too_large", dict(data=iter([b"[" + b"1," * 20000] * 4 + [b"1]"]),
                                                         headers=JSON)),
    "not json type": (415, "unsupported_media_type", dict(data=b"x=1", headers={**AUTH, "Content-Type": "text/plain"})),
    "malformed json": (400, "malformed_json", dict(data=b'{"x": [[1, 2', headers=JSON)),
    "bad base64": (422, "invalid_request", dict(json={"x": {"__tensor__": {"dtype": "float32", "shape": [1, 8],
                                                                         "data": "!!!"}}}, headers=AUTH)),
    "short data": (422, "invalid_request", dict(json={"x": {"__tensor__": {  # 4 elements' bytes for shape [1, 8]
        **codec.encode(torch.zeros(1, 4))["__tensor__"], "shape": [1, 8]}}}, headers=AUTH)),
    "bad dtype": (422, "invalid_request", dict(json={"x": {"__tensor__": {"dtype": "complex64", "shape": [1],
                                                                         "data": ""}}}, headers=AUTH)),
    "schema": (422, "invalid_request", dict(json={"x": [[1.0] * 8], "unknown": 1}, headers=AUTH)),
    "validator": (422, "rejected", dict(json={"x": [[1.0] * 5]}, headers=AUTH)),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_then_the_server_keeps_serving(url: str, case: str) -> None:
    status, kind, kwargs = BAD_REQUESTS[case]
    reply = requests.post(f"{url}/v1/step", timeout=60, **kwargs)
    assert reply.status_code == status, reply.text
    assert error_of(reply)["type"] == kind
    assert_good_step(url)


@pytest.mark.parametrize("method,path", [("GET", "/v1/replicas"), ("GET", "/metrics"), ("GET", "/docs"),
                                         ("GET", "/openapi.json"), ("POST", "/v1/step"), ("GET", "/nowhere")])
def test_api_key_is_required_on_every_route_but_the_probes(url: str, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = requests.request(method, url + path, headers=headers, json={"x": [[1.0] * 8]}, timeout=30)
        assert reply.status_code == 401 and reply.headers["WWW-Authenticate"] == "Bearer", (headers, reply.text)
    reply = requests.request(method, url + path, headers=AUTH, json={"x": [[1.0] * 8]}, timeout=30)
    assert reply.status_code == (404 if path == "/nowhere" else 200), reply.text
    for probe in ("/healthz", "/readyz"):
        assert requests.get(url + probe, timeout=10).status_code == 200


def test_openapi_documents_the_plugin_request_model(url: str) -> None:
    spec = requests.get(f"{url}/openapi.json", headers=AUTH, timeout=10).json()
    body = spec["paths"]["/v1/step"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/RowRequest")
    fields = spec["components"]["schemas"]["RowRequest"]["properties"]
    assert set(fields) == {"x", "sleep_s"}
    assert {"413", "415", "422", "503", "504"} <= set(spec["paths"]["/v1/step"]["post"]["responses"])


def test_metrics_endpoint_counts_requests(url: str) -> None:
    assert_good_step(url)
    text = requests.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line and not line.startswith("#")}
    assert lines['phyai_requests_total{route="/v1/step",status="200"}'] >= 1
    assert lines['phyai_requests_total{route="/v1/step",status="413"}'] >= 1
    assert lines['phyai_replica_healthy{engine_replica="0"}'] == 1.0
    assert 'phyai_request_latency_seconds_bucket{le="+Inf",route="/v1/step"}' in lines


def rank_actor_pids() -> list[int]:
    import ray

    return [a["Pid"] for a in ray._private.state.actors().values()
            if a.get("State") == "ALIVE" and "RankActor" in (a.get("ActorClassName") or "")]


def replicas(url: str) -> dict[str, Any]:
    return requests.get(f"{url}/v1/replicas", headers=AUTH, timeout=10).json()


def test_killed_rank_fails_its_group_and_the_other_keeps_serving(url: str) -> None:
    pids = rank_actor_pids()
    assert len(pids) == 4, pids
    os.kill(pids[0], signal.SIGKILL)

    def one_failed() -> dict[str, Any] | None:
        state = replicas(url)
        return state if any(not r["healthy"] for r in state["replicas"]) else None

    state = wait_until(one_failed, 30, "a replica group to be marked failed")
    failed = [r for r in state["replicas"] if not r["healthy"]]
    assert len(failed) == 1 and failed[0]["failure_reason"] == "worker_exit", state
    assert "exited" in failed[0]["failure"] and failed[0]["failed_rank"] in (0, 1)
    assert state["healthy"] and requests.get(f"{url}/readyz", timeout=10).status_code == 200
    for _ in range(4):
        assert_good_step(url)


def test_timeouts_are_504_then_503_until_the_groups_are_restarted(url: str) -> None:
    wait_until(lambda: all(r["healthy"] for r in replicas(url)["replicas"]), 120, "the killed group's restart")
    restarts = replicas(url)["rebuilds"]
    assert restarts >= 1
    with ThreadPoolExecutor(2) as pool:  # one slow request per group (fewest in flight)
        slow = [pool.submit(step, url, torch.ones(1, 8), sleep_s=EXECUTION_TIMEOUT_S + 6) for _ in range(2)]
        replies = [f.result() for f in slow]
    assert [r.status_code for r in replies] == [504, 504], [r.text for r in replies]
    assert all(error_of(r)["reason"] == "timeout" for r in replies)
    reply = step(url, torch.ones(1, 8))  # no group up: refused at once, nothing touched
    assert reply.status_code == 503 and error_of(reply)["type"] == "unavailable", reply.text
    assert requests.get(f"{url}/readyz", timeout=10).status_code == 503
    assert requests.get(f"{url}/healthz", timeout=10).status_code == 200
    wait_until(lambda: requests.get(f"{url}/readyz", timeout=10).status_code == 200, 120, "a group restart")
    assert_good_step(url)
    state = wait_until(lambda: (s := replicas(url))["rebuilds"] == restarts + 2 and s, 120, "both restarts")
    assert all(r["healthy"] for r in state["replicas"]), state


def test_ray_metrics_export_port_carries_the_request_counter(url: str) -> None:
    import ray

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    assert_good_step(url)

    def counter_lines() -> list[str]:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return [line for line in text.splitlines() if line.startswith("ray_phyai_requests_total{")]

    lines = wait_until(counter_lines, 40, "Ray's metrics agent to export ray_phyai_requests_total")
    assert any('route="/v1/step"' in line and 'status="200"' in line for line in lines), lines


def test_holder_reports_unhealthy_without_restart_and_restarts_failed_groups_with_it() -> None:
    holder = EngineHolder(FakeEngine)
    holder.check_health()
    holder.engine.fail(0)
    holder.check_health()  # replica 1 still serves
    holder.engine.fail(1)
    with pytest.raises(EngineUnavailableError, match="no replica group can serve: replica 0: rank 1 exited"):
        holder.check_health()
    restarting = EngineHolder(FakeEngine, rebuild_failed=True)
    restarting.engine.fail(1)
    restarting.check_health()  # starts the restart in the background, stays healthy meanwhile
    wait_until(lambda: restarting.rebuilds == 1, 10, "the restart")
    assert restarting.engine.restarted == [1] and restarting.engine.healthy
    restarting.check_health()
    holder.close()
    restarting.close()
    assert holder.engine.closed and restarting.engine.closed


class FakeEngine:
    """A stand-in engine with two replica groups whose health the test flips."""

    def __init__(self) -> None:
        self.up, self.closed, self.restarted = [True, True], False, []

    @property
    def healthy(self) -> bool:
        return not self.closed and any(self.up)

    def fail(self, index: int) -> None:
        self.up[index] = False

    def restart_replica(self, index: int) -> None:
        self.up[index] = True
        self.restarted.append(index)

    def replica_status(self) -> list[Any]:
        from phyai_ray.executors.base import ReplicaStatus

        return [ReplicaStatus(index=i, healthy=up, world_size=2, in_flight=0, served=0, errored=0,
                              failure=None if up else "rank 1 exited") for i, up in enumerate(self.up)]

    def close(self) -> None:
        self.closed = True
