"""The Open Inference Protocol v2 against a real Serve app: 2 groups x TP=2 of reference_dit (gloo, CPU).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_oip.py -q

The clients are the real ones from the package index: `tritonclient.http` here (test extra) and
`tritonclient.grpc` in a venv of its own (it pins protobuf < 7; tests/client_venv.py builds it).
Results must equal `Engine.step` of the same plugin: bit for bit the handle path of the same
groups, and within float32 rounding a single-rank inline engine. Malformed bodies that no real
client would produce (a shape that does not match the bytes, a truncated body) are sent with
`requests`. One Serve app serves the module; like test_serve_http.py it checks for leaks itself
after deleting its app from the session's Serve instance.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import requests
import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, Engine, EngineArgs,
                       EngineConfig, ParallelConfig)
from phyai_ray.config.deployment import WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig
from tests.client_venv import run_client
from tests.conftest import delete_serve_apps, shared_serve, wait_for_no_leaks

tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402
from tests.tolerances import reordered

KEY = "oip-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
APP = "oip"
PLUGIN_ARGS = {"seed": 3, "layers": 2}
TOKENS = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int64)
PARALLEL = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))


@pytest.fixture(scope="module")
def server() -> dict[str, Any]:
    from ray import serve

    from phyai_ray.serve import create_app

    serve_at = shared_serve()
    port, grpc_port = serve_at["port"], serve_at["grpc_port"]
    args = EngineArgs(plugin="reference_dit", plugin_args=PLUGIN_ARGS,
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=PARALLEL))
    deployment = DeploymentConfig.local(replica_count=2, cpus_per_rank=0.5,
                                        process_config=WorkerSupervisorConfig(startup_timeout_s=120))
    try:
        serve.run(create_app(args, deployment, api_key=KEY), name=APP, route_prefix="/")
        yield {"port": port, "grpc_port": grpc_port}
    finally:
        delete_serve_apps()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


@pytest.fixture(scope="module")
def client(server: dict[str, Any]) -> Any:
    return tritonclient_http.InferenceServerClient(f"127.0.0.1:{server['port']}", network_timeout=120)


@pytest.fixture(scope="module")
def expected(server: dict[str, Any]) -> dict[str, np.ndarray]:
    """Engine.step of the served groups (through their handle) and of one inline rank."""
    from phyai_ray.serve import group_handle

    request = {"tokens": torch.from_numpy(TOKENS), "guidance_scale": 4.0}
    served = group_handle(APP).step.remote(request).result(timeout_s=120).numpy()
    with Engine(EngineArgs(plugin="reference_dit", plugin_args=PLUGIN_ARGS,
                           config=EngineConfig(device=DeviceConfig(target="cpu")))) as engine:
        inline = engine.step(request).numpy()
    return {"served": served, "inline": inline}


def infer(client: Any, tokens: np.ndarray, binary: bool, **kwargs: Any) -> Any:
    x = tritonclient_http.InferInput("tokens", list(tokens.shape), "INT64")
    x.set_data_from_numpy(tokens, binary_data=binary)
    wanted = [tritonclient_http.InferRequestedOutput("logits", binary_data=binary)]
    # tritonclient adds Inference-Header-Content-Length to the headers dict it is given: a fresh one each call
    return client.infer("reference_dit", [x], outputs=wanted, parameters={"guidance_scale": 4.0}, headers=dict(AUTH),
                        **kwargs)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_http_gets_the_results_of_engine_step(client: Any, expected: dict, binary: bool) -> None:
    result = infer(client, TOKENS, binary, request_id=f"req-{binary}")
    logits = result.as_numpy("logits")
    assert logits.dtype == np.float32 and logits.shape == (2, 4, 128)
    assert np.array_equal(logits, expected["served"])  # same groups, same bits, JSON or binary
    want = expected["inline"]  # reference_dit's 256-term sums over 9 layers, served by other groups
    np.testing.assert_allclose(logits, want, **reordered(torch.float32, terms=256, depth=9, like=torch.from_numpy(want)))
    assert result.get_response()["id"] == f"req-{binary}"
    assert result.get_response()["model_name"] == "reference_dit"


def test_concurrent_clients_get_their_own_results(server: dict[str, Any], expected: dict) -> None:
    """16 requests from 8 threads over both groups: each answer is that request's (rows swapped: own result)."""
    swapped = TOKENS[::-1].copy()

    def one(i: int) -> bool:
        c = tritonclient_http.InferenceServerClient(f"127.0.0.1:{server['port']}", network_timeout=120)
        tokens = TOKENS if i % 2 == 0 else swapped
        got = infer(c, tokens, binary=i % 4 < 2).as_numpy("logits")
        want = expected["served"] if i % 2 == 0 else expected["served"][::-1]
        return bool(np.array_equal(got, want))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(16)))


def test_metadata_and_readiness_answer(client: Any, server: dict[str, Any]) -> None:
    assert client.is_server_live() and client.is_server_ready()  # the probes need no key
    assert client.is_model_ready("reference_dit", headers=AUTH)
    assert client.is_model_ready("reference_dit", "1", headers=AUTH)
    assert client.get_server_metadata(headers=AUTH)["extensions"] == ["binary_tensor_data"]
    meta = client.get_model_metadata("reference_dit", headers=AUTH)
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "tokens", "datatype": "INT64", "shape": [-1, -1]},
                              {"name": "labels", "datatype": "INT64", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, -1, -1]}]
    base = f"http://127.0.0.1:{server['port']}"
    assert requests.get(f"{base}/v2/health/ready", timeout=30).status_code == 200
    assert requests.get(f"{base}/v2/models/reference_dit", timeout=30).status_code == 401


def binary_header(size: int) -> bytes:
    return json.dumps({"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [2, 4],
                                   "parameters": {"binary_data_size": size}}],
                       "parameters": {"guidance_scale": 4.0}}).encode()


def raw_infer(port: int, body: bytes, header_length: int | None = None,
              request_id: str | None = None) -> requests.Response:
    headers = dict(AUTH, **({"X-Request-ID": request_id} if request_id else {}))
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = str(header_length)
    return requests.post(f"http://127.0.0.1:{port}/v2/models/reference_dit/infer", data=body, headers=headers,
                         timeout=60)


def test_bad_requests_get_the_protocols_errors_and_the_server_keeps_serving(client: Any, server: dict,
                                                                             expected: dict) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer("reference_dit", [], headers={"Authorization": "Bearer wrong"})
    assert info.value.status() == "401" and "API key" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer("no_such_model", [tritonclient_http.InferInput("tokens", [1, 1], "INT64")], headers=AUTH)
    assert info.value.status() == "404" and "unknown model 'no_such_model'" in info.value.message()
    port = server["port"]
    header = binary_header(64)  # [2, 4] INT64 = 64 bytes
    short = binary_header(48)  # the same shape, declared with 48 bytes
    replies = {
        "shape_vs_bytes": raw_infer(port, short + bytes(48), len(short)),
        "truncated": raw_infer(port, header + TOKENS.tobytes()[:40], len(header)),
        "datatype": raw_infer(port, json.dumps({"inputs": [{"name": "tokens", "datatype": "INT4", "shape": [1],
                                                            "data": [1]}]}).encode()),
        "not_json": raw_infer(port, b"{not json"),
        "nested_5000_deep": raw_infer(port, ('{"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], '
                                             '"data": ' + "[" * 5000 + "1" + "]" * 5000 + "}]}").encode()),
    }
    for case, reply in replies.items():
        assert reply.status_code == 400, (case, reply.status_code, reply.text)
        assert set(reply.json()) == {"error"} and isinstance(reply.json()["error"], str), (case, reply.text)
    assert "binary_data_size is 48" in replies["shape_vs_bytes"].json()["error"]
    assert "the body is truncated" in replies["truncated"].json()["error"]
    assert "unknown datatype 'INT4'" in replies["datatype"].json()["error"]
    assert "nested too deeply" in replies["nested_5000_deep"].json()["error"]
    good = raw_infer(port, header + TOKENS.tobytes(), len(header), request_id="trace-42")
    assert good.status_code == 200, good.text
    assert good.headers["X-Request-ID"] == "trace-42" and good.json()["id"] == "trace-42"  # no outputs asked: JSON
    (logits,) = good.json()["outputs"]
    assert logits["shape"] == [2, 4, 128] and np.array_equal(np.array(logits["data"], dtype=np.float32),
                                                             expected["served"].reshape(-1))
    assert np.array_equal(infer(client, TOKENS, binary=True).as_numpy("logits"), expected["served"])


def test_tritonclient_grpc_through_serves_grpc_proxy(server: dict[str, Any], expected: dict) -> None:
    out = run_client("oip_grpc_client.py", f"127.0.0.1:{server['grpc_port']}", KEY, "reference_dit",
                     json.dumps(TOKENS.tolist()))
    assert out["live"] and out["ready"] and out["model_ready"]
    assert out["server"]["extensions"] == ["binary_tensor_data"]
    assert [i["name"] for i in out["metadata"]["inputs"]] == ["tokens", "labels"]
    assert out["dtype"] == "float32" and out["id"] == "grpc-1"
    assert np.array_equal(np.array(out["logits"], dtype=np.float32), expected["served"])
    assert (out["wrong_key"], out["unknown_model"], out["bad_datatype"]) == \
        ("StatusCode.UNAUTHENTICATED", "StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT")
    assert out["after_errors"]


def test_oip_requests_are_counted_under_their_route(server: dict[str, Any]) -> None:
    """After the error test's four 400s (any group answered them): /metrics counts them as route "/v2"."""
    from tests.helpers import wait_until

    def counted() -> bool:
        text = requests.get(f"http://127.0.0.1:{server['port']}/metrics", headers=AUTH, timeout=30).text
        series = 'phyai_requests_total{route="/v2",status="400"}'
        lines = [line for line in text.splitlines() if line.startswith(series)]
        return bool(lines) and float(lines[0].split()[-1]) >= 4

    wait_until(counted, 30, "the /v2 400s in /metrics")
