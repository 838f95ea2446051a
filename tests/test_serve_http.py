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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import requests
import torch

from phyai_ray import DenseParallelConfig, DeploymentConfig, EngineArgs, EngineConfig, ParallelConfig
from phyai_ray.config.deployment import WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.errors import EngineOverloadedError, EngineUnavailableError, RequestTimeoutError
from phyai_ray.serve import codec
from phyai_ray.serve.holder import EngineHolder
from tests.conftest import RAY_CPUS, wait_for_no_leaks
from tests.helpers import asgi_request, free_port, post_step, wait_until
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
    assert all(error_of(r)["reason"] in ("timeout", "request_timeout") for r in replies)  # hung group / deadline
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


# -- the status of every engine error, in process: the ASGI app around a stand-in engine (no Ray) -----------

class StepEntry:
    """The plugin side the edge sees: no request model; the validator refuses a body with "bad"."""

    request_model = None

    def display_name(self) -> str:
        return "step-entry"

    def validate_request(self, request: Any) -> None:
        if "bad" in request:
            raise ValueError("x must be a list of 8 numbers")


class StepEngine:
    """`submit` raises `at_submit`; else its future fails with `in_future` (or holds a result)."""

    mode = "local"

    def __init__(self, at_submit: BaseException | None = None, in_future: BaseException | None = None,
                 healthy: bool = True) -> None:
        self.at_submit, self.in_future, self.healthy = at_submit, in_future, healthy
        self.entry, self.submitted = StepEntry(), []

    def submit(self, request: Any) -> Future:
        if self.at_submit is not None:
            raise self.at_submit
        self.submitted.append(request)
        future: Future = Future()
        if self.in_future is not None:
            future.set_exception(self.in_future)
        else:
            future.set_result({"ok": True})
        return future

    def replica_status(self) -> list[Any]:
        from phyai_ray.executors.base import ReplicaStatus

        return [ReplicaStatus(index=0, healthy=self.healthy, world_size=2, in_flight=0, served=0, errored=0,
                              failure=None if self.healthy else "rank 1 exited on node 10.0.0.7 (secret-host)")]

    def close(self) -> None:
        pass


def edge(engine: StepEngine, **options: Any) -> Any:
    from phyai_ray.serve.http import create_api
    from phyai_ray.serve.options import ServeOptions

    return create_api(EngineHolder(lambda: engine), ServeOptions(api_key=KEY, **options), wait_s=10)


ENGINE_ERRORS = {  # case: (engine, options, status, type, reason, Retry-After)
    "overloaded": (dict(at_submit=EngineOverloadedError("all queues full", queued=8, limit=8)), {},
                   503, "overloaded", None, True),
    "overloaded as 429": (dict(at_submit=EngineOverloadedError("all queues full")), {"overload_status": 429},
                          429, "overloaded", None, True),
    "request timeout": (dict(in_future=RequestTimeoutError("no result after 4s", replica=0)), {},
                        504, "timeout", "request_timeout", False),
    "group hung": (dict(in_future=EngineUnavailableError("ran past 4s", reason="timeout")), {},
                   504, "timeout", "timeout", False),
    "plugin raised in a group": (dict(in_future=EngineUnavailableError("rank 0 raised", reason="exception")), {},
                                 500, "execution_error", "exception", False),
    "worker exited": (dict(in_future=EngineUnavailableError("rank 1 exited", reason="worker_exit")), {},
                      503, "unavailable", "worker_exit", True),
    "no healthy replica": (dict(at_submit=EngineUnavailableError("none", reason="no_healthy_replica")), {},
                           503, "unavailable", "no_healthy_replica", True),
    "server fault in submit": (dict(at_submit=KeyError("dispatcher bug")), {}, 500, "internal", None, False),
    "plugin raised inline": (dict(in_future=ValueError("nan in layer 3")), {}, 500, "execution_error", None, False),
}


@pytest.mark.parametrize("case", list(ENGINE_ERRORS))
def test_each_engine_error_gets_its_status_type_and_retry_after(case: str) -> None:
    engine_kw, options, status, kind, reason, retry = ENGINE_ERRORS[case]
    got, headers, body = asgi_request(edge(StepEngine(**engine_kw), **options), "POST", "/v1/step",
                                      {"x": [1.0] * 8}, AUTH)
    assert (got, body["error"]["type"], body["error"].get("reason")) == (status, kind, reason), body
    assert ("retry-after" in headers) == retry, headers


def test_only_the_plugin_validator_makes_a_4xx_and_nothing_is_submitted() -> None:
    engine = StepEngine()
    status, _, body = asgi_request(edge(engine), "POST", "/v1/step", {"bad": 1}, AUTH)
    assert status == 422 and body["error"]["type"] == "rejected" and "8 numbers" in body["error"]["message"]
    assert engine.submitted == []
    assert asgi_request(edge(engine), "POST", "/v1/step", {"x": [1.0] * 8}, AUTH)[:3:2] == (200, {"result": {"ok": True}})


def test_readyz_says_ready_or_not_and_nothing_more() -> None:
    assert asgi_request(edge(StepEngine()), "GET", "/readyz")[::2] == (200, {"ready": True})
    status, headers, body = asgi_request(edge(StepEngine(healthy=False)), "GET", "/readyz")
    assert status == 503 and "retry-after" in headers and body["error"]["type"] == "unavailable"
    assert "exited" not in str(body) and "10.0.0.7" not in str(body) and "secret-host" not in str(body), body
    status, _, body = asgi_request(edge(StepEngine(healthy=False)), "GET", "/v1/replicas", headers=AUTH)
    assert status == 200 and "secret-host" in body["replicas"][0]["failure"]  # the details need the key


@pytest.mark.parametrize("exc,status", [
    (EngineOverloadedError("full"), 503), (RequestTimeoutError("late"), 504),
    (EngineUnavailableError("hung", reason="timeout"), 504), (EngineUnavailableError("raised", reason="exception"), 500),
    (EngineUnavailableError("closed", reason="closed"), 503), (RuntimeError("bug"), 500),
])
def test_from_engine_error_never_blames_the_client(exc: BaseException, status: int) -> None:
    from phyai_ray.serve.errors import from_engine_error

    assert from_engine_error(exc).status_code == status
    assert from_engine_error(exc, overload_status=429).status_code == (429 if status == 503 and
                                                                       isinstance(exc, EngineOverloadedError) else status)
