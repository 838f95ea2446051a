"""The Serve app over real HTTP: 2 replica groups x TP=2 of `serve_row_tp` (gloo on CPU).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_serve_http.py -q

One Serve app serves the whole module (starting it costs most of the runtime); each of its two
Serve replicas is one replica group. The tests run in file order and the later ones break groups
on purpose: a killed rank fails group A while group B serves every request, and Serve replaces A
(new pids) without touching B; two requests past `execution_timeout_s` fail both groups (504
each), requests get 503 until Serve has replaced them, then 200 again.
The module neither uses `ray_session` nor the `ray` marker: conftest's per-test leak check would
see the app's live rank actors and placement groups between tests. It checks for leaks itself,
once, after deleting its app from the session's Serve instance.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import requests
import torch

from phyai_ray import BatchingConfig, DenseParallelConfig, DeploymentConfig, EngineArgs, EngineConfig, ParallelConfig
from phyai_ray.config.deployment import WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.errors import EngineOverloadedError, EngineUnavailableError, RequestTimeoutError
from phyai_ray.serve.protocols import codec
from phyai_ray.serve.runtime.holder import EngineHolder
from phyai_ray.serve.runtime.runner import GroupRunner
from phyai_ray.validation import Validated
from tests.conftest import delete_serve_apps, shared_serve, wait_for_no_leaks
from tests.helpers import asgi_request, free_port, post_step, wait_until
from tests.plugins.tiny import reference

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
EXECUTION_TIMEOUT_S = 4.0
PLUGIN = "tests.plugins.serve_plugins:ServeRowTPEntry"
APP = "phyai-http"


@pytest.fixture(scope="module")
def url() -> str:
    from ray import serve

    from phyai_ray.serve import create_app

    port = shared_serve()["port"]
    args = EngineArgs(plugin=PLUGIN, config=EngineConfig(device=DeviceConfig(target="cpu"),
                                                        parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    deployment = DeploymentConfig.local(replica_count=2, batching=BatchingConfig(max_batch_size=16),
                                        process_config=WorkerSupervisorConfig(
                                            execution_timeout_s=EXECUTION_TIMEOUT_S, startup_timeout_s=120))
    try:
        serve.run(create_app(args, deployment, api_key=KEY, max_body_bytes=MAX_BODY, health_check_period_s=1.0), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        delete_serve_apps()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


def step(url: str, x: torch.Tensor, **extra: Any) -> requests.Response:
    return post_step(url, {"x": x}, key=KEY, **extra)


def assert_good_step(url: str) -> dict[str, Any]:
    x = torch.randint(-5, 5, (3, 8)).float()
    reply = step(url, x)
    assert reply.status_code == 200, reply.text
    result = codec.decode(reply.json()["result"])
    assert result["tp"] == 2 and torch.equal(result["y"], reference(x))
    return result


def error_of(reply: requests.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"} and {"type", "message"} <= set(body["error"]), body
    return body["error"]


def replicas(url: str) -> dict[str, Any]:
    return requests.get(f"{url}/v1/replicas", headers=AUTH, timeout=10).json()


def serving(url: str) -> dict[str, dict[str, Any]]:
    """group id -> row, for the groups that serve now."""
    return {r["group"]: r for r in replicas(url)["replicas"] if r["state"] == "serving"}


def test_step_round_trips_tensors_over_both_groups(url: str) -> None:
    pids = set()
    for dtype in (torch.float32, torch.float64, torch.int64):
        x = torch.arange(16, dtype=dtype).reshape(2, 8) - 7
        reply = step(url, x)
        assert reply.status_code == 200, reply.text
        result = codec.decode(reply.json()["result"])
        assert result["y"].dtype == torch.float32 and torch.equal(result["y"], reference(x))
        pids.add(result["pid"])
    plain = requests.post(f"{url}/v1/step", json={"x": [[1.0] * 8]}, headers=AUTH, timeout=60)
    assert codec.decode(plain.json()["result"])["y"].tolist() == reference([[1.0] * 8]).tolist()
    assert len(pids) == 2, pids  # one at a time: ties go to the least recently chosen group
    groups = wait_until(lambda: len(s := serving(url)) == 2 and sum(r["served"] for r in s.values()) == 4 and s,
                        10, "both groups to report what they served")  # each report is at most ~0.5 s old
    assert all(r["served"] >= 1 for r in groups.values())
    assert all(len(r["pids"]) == 2 and r["world_size"] == 2 for r in groups.values()), groups


def test_requests_from_many_http_clients_batch_inside_each_group(url: str) -> None:
    xs = [torch.randint(-5, 5, (1 + i % 3, 8)).float() for i in range(24)]
    with ThreadPoolExecutor(24) as pool:
        replies = list(pool.map(lambda x: step(url, x, sleep_s=0.3), xs))
    results = [codec.decode(r.json()["result"]) for r in replies]
    assert all(torch.equal(res["y"], reference(x)) for res, x in zip(results, xs))
    assert max(res["batch"] for res in results) > 1, "no two HTTP requests shared a step"
    assert len({res["pid"] for res in results}) == 2  # both groups served, each batching its own queue
    lines = metric_lines(url)
    count = lines['phyai_replica_batch_size_count{engine_replica="%s"}' % _answering(lines)]
    total = lines['phyai_replica_batch_size_sum{engine_replica="%s"}' % _answering(lines)]
    assert total > count >= 1  # more samples than steps: the answering group batched
    assert any(k.startswith("phyai_replica_queue_wait_seconds_bucket") for k in lines)


def _answering(lines: dict[str, float]) -> str:
    """The group whose batch histograms /metrics showed (the answering group's)."""
    [label] = {k.split('engine_replica="')[1].split('"')[0] for k in lines if k.startswith("phyai_replica_batch_size_count")}
    return label


JSON = {**AUTH, "Content-Type": "application/json"}
_T = codec.encode(torch.zeros(1, 8))
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


def metric_lines(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_cover_every_group_whichever_answers(url: str) -> None:
    assert_good_step(url)
    groups = serving(url)
    served = sum(r["served"] for r in groups.values())

    def complete() -> dict[str, float] | None:  # each group's counts arrive with its next report
        lines = metric_lines(url)
        want = [f'phyai_replica_healthy{{engine_replica="{g}"}}' for g in groups]
        ok = lines.get('phyai_requests_total{route="/v1/step",status="200"}', 0) >= served
        return lines if ok and all(k in lines for k in want) and lines.get(
            'phyai_requests_total{route="/v1/step",status="413"}', 0) >= 2 else None

    for _ in range(3):  # three scrapes, answered by either group
        lines = wait_until(complete, 15, "/metrics to cover both groups")
        assert all(lines[f'phyai_replica_healthy{{engine_replica="{g}"}}'] == 1.0 for g in groups)
        assert 'phyai_request_latency_seconds_bucket{le="+Inf",route="/v1/step"}' in lines


def test_a_ray_task_calls_the_groups_through_their_handle(url: str) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def call(x: torch.Tensor) -> Any:
        from phyai_ray.serve import group_handle

        return group_handle(APP).step.remote({"x": x}).result(timeout_s=60)

    x = torch.randint(-5, 5, (2, 8)).float()
    result = ray.get(call.remote(x), timeout=120)
    assert result["tp"] == 2 and torch.equal(result["y"], reference(x))


def rank_pids(row: dict[str, Any]) -> set[int]:
    return set(row["pids"])


def test_killed_rank_fails_its_group_the_other_serves_and_serve_replaces_it(url: str) -> None:
    before = serving(url)
    assert len(before) == 2, before
    victim, survivor = sorted(before)
    os.kill(before[victim]["pids"][1], signal.SIGKILL)

    def failed() -> dict[str, Any] | None:
        rows = {r["group"]: r for r in replicas(url)["replicas"]}
        return rows[victim] if rows.get(victim, {}).get("state") in ("failed", "gone") else None

    row = wait_until(failed, 30, "the killed rank's group to be reported failed")
    assert row["failure_reason"] == "worker_exit" and "exited" in row["failure"] and row["failed_rank"] in (0, 1), row
    assert requests.get(f"{url}/readyz", timeout=10).status_code == 200
    for _ in range(6):  # before and after Serve replaces the failed group: never refused
        assert_good_step(url)

    def replaced() -> dict[str, dict[str, Any]] | None:
        now = serving(url)
        return now if len(now) == 2 and victim not in now else None

    after = wait_until(replaced, 90, "Serve to bring up a new group in place of the failed one")
    new = next(g for g in after if g != survivor)
    assert after[survivor]["pids"] == before[survivor]["pids"], "the healthy group was restarted"
    assert after[survivor]["replica_pid"] == before[survivor]["replica_pid"]
    assert not rank_pids(after[new]) & (rank_pids(before[victim]) | rank_pids(before[survivor])), after
    assert_good_step(url)


def test_timeouts_are_504_then_503_until_serve_replaces_the_groups(url: str) -> None:
    wait_until(lambda: len(serving(url)) == 2, 90, "two serving groups")
    with ThreadPoolExecutor(2) as pool:  # one slow request per group (fewest in flight)
        slow = [pool.submit(step, url, torch.ones(1, 8), sleep_s=EXECUTION_TIMEOUT_S + 6) for _ in range(2)]
        replies = [f.result() for f in slow]
    assert [r.status_code for r in replies] == [504, 504], [r.text for r in replies]
    assert all(error_of(r)["reason"] in ("timeout", "request_timeout") for r in replies)  # hung group / deadline
    reply = step(url, torch.ones(1, 8))  # both groups failed: it waits for a new group (<= 30 s), else 503
    assert reply.status_code in (503, 200), reply.text
    if reply.status_code == 503:
        assert error_of(reply)["type"] == "unavailable" and "retry-after" in {k.lower() for k in reply.headers}
    assert requests.get(f"{url}/healthz", timeout=10).status_code == 200
    wait_until(lambda: requests.get(f"{url}/readyz", timeout=10).status_code == 200, 120, "a replaced group")
    assert_good_step(url)  # ready means a group that Serve routes to: every request reaches one
    wait_until(lambda: len(serving(url)) == 2, 120, "both groups replaced")


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

    def served_name(self) -> str:
        return self.display_name()

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


def edge(engine: StepEngine, forward: Any = None, **options: Any) -> Any:
    from phyai_ray.serve.protocols.http import create_api
    from phyai_ray.serve.runtime.options import ServeOptions

    runner = GroupRunner(EngineHolder(lambda: engine), group="g0", wait_s=10, forward=forward)
    return create_api(runner, ServeOptions(api_key=KEY, **options))


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


def test_tensor_budgets_of_one_request_are_422_before_any_submit() -> None:
    engine = StepEngine()
    body = {"x": [1.0] * 8, "extra": [_T] * 5}
    status, _, reply = asgi_request(edge(engine, max_tensors=4), "POST", "/v1/step", body, AUTH)
    assert status == 422 and "more than 4 tensors" in reply["error"]["message"], reply
    status, _, reply = asgi_request(edge(engine, max_tensor_bytes=100), "POST", "/v1/step", body, AUTH)
    assert status == 422 and "pass 100 bytes together" in reply["error"]["message"], reply
    assert engine.submitted == []


def test_a_failed_group_forwards_what_it_never_started() -> None:
    sent = []

    async def forward(request: Any, hops: int, failed: tuple) -> Any:
        sent.append((request, hops, failed))
        return {"from": "peer"}

    down = dict(at_submit=EngineUnavailableError("group failed", reason="no_healthy_replica"), healthy=False)
    status, _, body = asgi_request(edge(StepEngine(**down), forward=forward), "POST", "/v1/step", {"x": [1.0]}, AUTH)
    assert (status, body, sent) == (200, {"result": {"from": "peer"}}, [(Validated({"x": [1.0]}), 1, ("g0",))])
    import asyncio

    from phyai_ray.serve.runtime.registry import failed_here, set_failed
    from phyai_ray.serve.runtime.runner import MAX_HOPS

    runner = GroupRunner(EngineHolder(lambda: StepEngine(**down)), group="g1", forward=forward)
    try:
        assert asyncio.run(runner.run({"x": [1.0]}, hops=1, failed=("g0",))) == {"from": "peer"}
        assert sent[-1][1:] == (2, ("g0", "g1")) and failed_here("g0") and failed_here("g1")
        with pytest.raises(EngineUnavailableError):  # after MAX_HOPS failed groups: the cause, no more hops
            asyncio.run(runner.run({"x": [1.0]}, hops=MAX_HOPS))
    finally:
        set_failed("g0", False)
        set_failed("g1", False)


class _Replica:
    def __init__(self, name: str, failed: bool = False) -> None:
        from ray.serve.request_router import ReplicaID

        self.replica_id = ReplicaID(unique_id=name, deployment_id=None)
        self.routing_stats = {"phyai_failed": failed}


def test_router_ranks_fewest_in_flight_then_least_recently_chosen_and_skips_failed() -> None:
    from phyai_ray.serve.runtime.registry import set_failed
    from phyai_ray.serve.runtime.router import rank_groups

    a, b, c, d = _Replica("a"), _Replica("b"), _Replica("c"), _Replica("d", failed=True)
    ids = {r.replica_id.unique_id: r.replica_id for r in (a, b, c, d)}
    in_flight = {ids["a"]: 2, ids["b"]: 0, ids["c"]: 0, ids["d"]: 0}
    order = rank_groups([a, b, c, d], in_flight, {ids["b"]: 5, ids["c"]: 3})
    assert [r.replica_id.unique_id for r in order] == ["c", "b", "a"]
    assert [r.replica_id.unique_id for r in rank_groups([a, b], {}, {ids["a"]: 1})] == ["b", "a"]  # unknown = 0
    set_failed("c", True)
    try:
        assert [r.replica_id.unique_id for r in rank_groups([a, b, c], in_flight, {})] == ["b", "a"]
        assert len(rank_groups([c, d], in_flight, {})) == 2  # all failed: a new request still reaches one
        assert rank_groups([c, d], in_flight, {}, forwarded=True) == []  # a forwarded one waits for a healthy one
    finally:
        set_failed("c", False)


@pytest.mark.parametrize("exc,status", [
    (EngineOverloadedError("full"), 503), (RequestTimeoutError("late"), 504),
    (EngineUnavailableError("hung", reason="timeout"), 504), (EngineUnavailableError("raised", reason="exception"), 500),
    (EngineUnavailableError("closed", reason="closed"), 503), (RuntimeError("bug"), 500),
])
def test_from_engine_error_never_blames_the_client(exc: BaseException, status: int) -> None:
    from phyai_ray.serve.protocols.error_map import from_engine_error

    assert from_engine_error(exc).status_code == status
    assert from_engine_error(exc, overload_status=429).status_code == (429 if status == 503 and
                                                                       isinstance(exc, EngineOverloadedError) else status)
