"""The served OpenAPI document declares the errors every route can answer (a client generated from it
knows them): 401 on every route behind the key (never on the open probes), 500 everywhere, and the body
and engine errors (400, 413, 415, 422, 429, 503, 504) on every route that takes a body. The phyai-ray
routes' errors carry `ErrorBody`'s schema; the OpenAI and OIP routes answer in their protocol's shape.

The whole app of one group (create_api) over an inline `reference_lm` engine: no Ray, no Serve.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from phyai_ray import Engine, EngineArgs
from phyai_ray.serve.protocols.guard import OPEN_PATHS
from phyai_ray.serve.runtime.holder import EngineHolder
from phyai_ray.serve.protocols.http import create_api
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.serve.runtime.runner import GroupRunner

KEY = "k-openapi"


@pytest.fixture(scope="module")
def spec() -> dict:
    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0}, config={"device": {"target": "cpu"}})
    with Engine(args) as engine:
        api = create_api(GroupRunner(EngineHolder(lambda: engine)), ServeOptions(api_key=KEY))
        with TestClient(api) as http:
            reply = http.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
            assert reply.status_code == 200, reply.text
            return reply.json()


def operations(spec: dict):
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            yield path, method, op


def test_every_route_declares_the_errors_it_can_answer(spec):
    seen = {path for path, _, _ in operations(spec)}
    assert {"/v1/step", "/v1/step/stream", "/v1/completions", "/v1/models", "/v1/replicas", "/metrics",
            "/readyz"} <= seen, sorted(seen)
    assert any(path.startswith("/v2/") for path in seen), "the OIP routes are part of the app"
    missing = {}
    for path, method, op in operations(spec):
        want = ({"500"} if path in OPEN_PATHS else {"401", "500"}) | (
            {"400", "413", "415", "422", "429", "503", "504"} if method in ("post", "put") else set())
        lacking = want - set(op["responses"])
        if lacking:
            missing[f"{method.upper()} {path}"] = sorted(lacking)
    assert not missing, f"routes that do not declare errors they can answer: {missing}"


def test_open_probes_declare_no_key_error_and_phyai_errors_carry_their_schema(spec):
    for probe in ("/healthz", "/readyz"):
        assert "401" not in spec["paths"][probe]["get"]["responses"], probe
    for path in ("/v1/replicas", "/v1/step/stream"):
        method = "get" if path == "/v1/replicas" else "post"
        body = spec["paths"][path][method]["responses"]["401"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/ErrorBody"), (path, body)
    assert "content" not in spec["paths"]["/v1/completions"]["post"]["responses"]["401"], \
        "an OpenAI route's errors are not phyai-ray's ErrorBody"
