"""A request is validated once, wherever it enters, and runs in the form the validator returned.

One request through `Engine.submit`, `/v1/step`, the Open Inference Protocol (HTTP), openpi's
WebSocket, a Serve handle's path (`GroupRunner.run`) and the OpenAI routes runs the plugin's
`validate_request` exactly once; a refusal is `RequestRejectedError`, which every edge answers
with its bad-request status. The apps are the real ones, around an inline engine (no Ray).

Run: .venv/bin/pytest tests/test_validate_once.py -q
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from phyai_ray import Engine, EngineArgs, RequestRejectedError
from phyai_ray.models.reference_lm import ReferenceLMEntry
from phyai_ray.plugins.entry import Entry
from phyai_ray.serve.runtime.holder import EngineHolder
from phyai_ray.serve.protocols.openpi import pack, unpack
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.serve.runtime.runner import GroupRunner
from phyai_ray.validation import Validated, validate
from tests.helpers import asgi_request

CPU = {"device": {"target": "cpu"}}


class Counted:
    """Counts `validate_request` calls (thread-safe: the edges validate on worker threads)."""

    def _count(self) -> None:
        with self._lock:
            self.calls += 1

    def take(self) -> int:
        """The calls since the last take."""
        with self._lock:
            calls, self.calls = self.calls, 0
        return calls


class Doubler:
    def step(self, request: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(request["x"], torch.Tensor):  # the raw form reached the rank: the parsed one was lost
            raise TypeError(f"the rank got x as {type(request['x']).__name__}, not the validator's tensor")
        return {"y": request["x"] * 2}

    def stream(self, request: dict[str, Any], emit: Any) -> dict[str, Any]:
        emit(request["x"].tolist())
        return self.step(request)


class CountingEntry(Counted, Entry):
    """{"x": numbers} -> {"y": 2x}; its validator returns x as a tensor, the form the rank needs."""

    name = "counting"

    def __init__(self) -> None:
        self.calls, self._lock = 0, threading.Lock()

    def validate_request(self, request: Any) -> dict[str, Any]:
        self._count()
        if not isinstance(request, dict) or "x" not in request:
            raise ValueError(f"counting wants {{'x': numbers}}, got {request!r:.60}")
        return {"x": torch.as_tensor(request["x"], dtype=torch.float32)}

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> Doubler:
        return Doubler()


class CountingLM(Counted, ReferenceLMEntry):
    """reference_lm, counting its validator's calls."""

    def __init__(self) -> None:
        self.calls, self._lock = 0, threading.Lock()
        super().__init__()

    def validate_request(self, request: Any) -> Any:
        self._count()
        return super().validate_request(request)


def _app(engine: Engine) -> Any:
    from phyai_ray.serve.protocols.http import create_api

    return create_api(GroupRunner(EngineHolder(lambda: engine)), ServeOptions())


@pytest.fixture(scope="module")
def doubler():
    with Engine(EngineArgs(plugin=CountingEntry(), config=CPU)) as engine:
        engine.entry.take()
        yield engine


def test_engine_submit_validates_once_and_not_a_validated_request(doubler):
    assert doubler.submit({"x": [1.0, 2.0]}).result(timeout=30)["y"].tolist() == [2.0, 4.0]
    assert doubler.entry.take() == 1
    checked = validate(doubler.entry, {"x": [3.0]})
    assert doubler.entry.take() == 1 and isinstance(checked, Validated)
    assert doubler.step(checked)["y"].tolist() == [6.0] and list(doubler.stream(checked)) == [[3.0]]
    assert doubler.entry.take() == 0


def test_a_refusal_is_the_typed_rejection_with_the_plugins_message(doubler):
    with pytest.raises(RequestRejectedError, match="counting wants") as info:
        doubler.submit({"y": 1})
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, ValueError)
    assert info.value.plugin == "counting" and doubler.entry.take() == 1


def test_the_rejection_names_the_field_and_survives_pickling():
    import pickle

    from pydantic import BaseModel

    class Body(BaseModel):
        steps: int

    class Strict(Entry):
        name = "strict"

        def validate_request(self, request: Any) -> None:
            Body.model_validate(request)

    with pytest.raises(RequestRejectedError, match="plugin strict rejected the request: ValidationError") as info:
        validate(Strict(), {"steps": "many"})
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.plugin, again.field, str(again)) == ("strict", "steps", str(info.value))


def test_v1_step_validates_once_and_a_refusal_is_422(doubler):
    app = _app(doubler)
    status, _, body = asgi_request(app, "POST", "/v1/step", {"x": [1.0, 2.0]})
    assert status == 200 and doubler.entry.take() == 1, body
    status, _, body = asgi_request(app, "POST", "/v1/step", {"z": 1})
    assert (status, body["error"]["type"]) == (422, "rejected") and "counting wants" in body["error"]["message"]
    assert doubler.entry.take() == 1


def test_oip_validates_once_and_a_refusal_is_400(doubler):
    app = _app(doubler)
    infer = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}
    status, _, body = asgi_request(app, "POST", "/v2/models/counting/infer", infer)
    assert status == 200 and body["outputs"][0]["data"] == [2.0, 4.0] and doubler.entry.take() == 1, body
    infer["inputs"][0]["name"] = "z"
    status, _, body = asgi_request(app, "POST", "/v2/models/counting/infer", infer)
    assert status == 400 and "counting wants" in body["error"] and doubler.entry.take() == 1, body


def test_openpi_validates_each_frame_once_and_a_refused_frame_keeps_the_session(doubler):
    with TestClient(_app(doubler)) as client, client.websocket_connect("/v1/openpi") as ws:
        unpack(ws.receive_bytes(), 1 << 20)  # the metadata frame
        ws.send_bytes(pack({"x": np.array([1.0, 2.0], dtype=np.float32)}))
        reply = unpack(ws.receive_bytes(), 1 << 20)
        assert reply["y"].tolist() == [2.0, 4.0] and doubler.entry.take() == 1
        ws.send_bytes(pack({"z": np.array([1.0], dtype=np.float32)}))
        refused = ws.receive_text()
        assert "bad observation" in refused and "counting wants" in refused and doubler.entry.take() == 1
        ws.send_bytes(pack({"x": np.array([3.0], dtype=np.float32)}))
        assert unpack(ws.receive_bytes(), 1 << 20)["y"].tolist() == [6.0] and doubler.entry.take() == 1


def test_a_handle_callers_request_is_validated_once_by_the_group(doubler):
    runner = GroupRunner(EngineHolder(lambda: doubler))
    assert asyncio.run(runner.run({"x": [1.0]}))["y"].tolist() == [2.0]
    assert doubler.entry.take() == 1
    with pytest.raises(RequestRejectedError):
        asyncio.run(runner.run({"z": 1}))
    assert doubler.entry.take() == 1


@pytest.fixture(scope="module")
def lm():
    with Engine(EngineArgs(plugin=CountingLM(), plugin_args={"seed": 0}, config=CPU)) as engine:
        engine.entry.take()
        yield engine


@pytest.mark.parametrize("stream", [False, True])
def test_openai_completions_validate_once_and_a_refusal_is_400(lm, stream):
    from fastapi import FastAPI

    from phyai_ray.serve.protocols.openai.api import add_openai_routes

    api = FastAPI()
    add_openai_routes(api, GroupRunner(EngineHolder(lambda: lm)))
    with TestClient(api) as client:
        reply = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "n": 2, "stream": stream})
        assert reply.status_code == 200 and ("[DONE]" in reply.text if stream else len(reply.json()["choices"]) == 2)
        assert lm.entry.take() == 1
        refused = client.post("/v1/completions", json={"prompt": [1, 10 ** 6], "max_tokens": 3})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["type"] == "invalid_request_error", error
        assert "rejected the request" in error["message"] and lm.entry.take() == 1


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("transformers")
    from phyai_ray.models.hf_causal_lm import HFCausalLMEntry
    from tests.hf_checkpoints import write_checkpoint

    class CountingHF(Counted, HFCausalLMEntry):
        def __init__(self) -> None:
            self.calls, self._lock = 0, threading.Lock()
            super().__init__()

        def validate_request(self, request: Any) -> Any:
            self._count()
            return super().validate_request(request)

    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-qwen2", "qwen2")
    with Engine(EngineArgs(plugin=CountingHF(), plugin_args={"model": str(folder)}, config=CPU)) as engine:
        engine.entry.take()
        yield engine


def test_text_is_tokenized_once_and_the_chat_route_validates_once(hf, monkeypatch):
    from fastapi import FastAPI

    from phyai_ray.serve.protocols.openai.api import add_openai_routes

    codec_type, encoded = type(hf.entry.codec), []
    plain = codec_type.encode
    monkeypatch.setattr(codec_type, "encode", lambda self, *a, **k: encoded.append(a) or plain(self, *a, **k))
    runner = GroupRunner(EngineHolder(lambda: hf))
    [out] = asyncio.run(runner.run({"text": ["The quick brown"], "max_tokens": 2}))  # a handle caller's request
    assert out.text is not None and (hf.entry.take(), len(encoded)) == (1, 1)  # the parsed form ran
    [out] = hf.step({"text": "The quick brown", "max_tokens": 2})
    assert out.text is not None and (hf.entry.take(), len(encoded)) == (1, 2)
    api = FastAPI()
    add_openai_routes(api, runner)
    with TestClient(api) as client:
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2})
        assert reply.status_code == 200 and hf.entry.take() == 1, reply.text
