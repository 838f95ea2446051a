"""EdgeGuard answers a method a route does not declare with 405, not with a body check's 415 (pure ASGI,
no server): `.venv/bin/python -m pytest tests/test_guard_methods.py -q`."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI

from phyai_ray.serve.protocols.guard import EdgeGuard


def _app() -> FastAPI:
    api = FastAPI()

    @api.post("/v1/step")
    async def step(body: dict) -> dict:
        return {"result": body}

    api.add_middleware(EdgeGuard, keys={"k": "default"}, max_body_bytes=1 << 20)
    return api


def _call(app: FastAPI, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict, dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    head = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], head, json.loads(payload) if payload else {}


def test_undeclared_method_is_405_not_415():
    app = _app()
    auth = {"authorization": "Bearer k"}
    status, head, _ = _call(app, "PUT", "/v1/step", {**auth, "content-type": "text/plain"}, b"x")
    assert status == 405 and "POST" in head.get("allow", ""), (status, head)
    status, _, _ = _call(app, "POST", "/v1/step", {**auth, "content-type": "text/plain"}, b"x")
    assert status == 415  # the declared method still gets the content-type check
    status, _, body = _call(app, "POST", "/v1/step", {**auth, "content-type": "application/json"}, b'{"a": 1}')
    assert status == 200 and body == {"result": {"a": 1}}
    status, _, _ = _call(app, "PUT", "/v1/step", {"content-type": "text/plain"}, b"x")
    assert status == 401  # the key is checked first, whatever the method
    status, _, _ = _call(app, "PUT", "/nowhere", {**auth, "content-type": "text/plain"}, b"x")
    assert status == 415  # no route has the path: the body checks apply as before
