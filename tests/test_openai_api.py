"""The OpenAI-compatible routes, driven by the real `openai` client against the app in this process.

The routes run on a real inline `reference_lm` engine (no Ray, no Serve): `TestClient` is an
httpx client, so `openai.OpenAI(http_client=...)` talks to the ASGI app directly. The same
routes on a real Serve HTTP server are tested in the serve tests.

Run: .venv/bin/pytest tests/test_openai_api.py -q
"""

from __future__ import annotations


import pytest
import torch
from fastapi import FastAPI
from starlette.testclient import TestClient

from phyai_ray import Engine, EngineArgs
from phyai_ray.models.reference_lm import ReferenceLMConfig, full_weights, score
from phyai_ray.serve.runtime.holder import EngineHolder
from phyai_ray.serve.protocols.openai.api import add_openai_routes
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.serve.runtime.runner import GroupRunner

openai = pytest.importorskip("openai")


def InlineRunner(engine: Engine) -> GroupRunner:
    """The Serve group's own request path (GroupRunner), over one engine in this process."""
    return GroupRunner(EngineHolder(lambda: engine))


@pytest.fixture(scope="module")
def client():
    with Engine(EngineArgs(plugin="reference_lm", plugin_args={"seed": 0}, config={"device": {"target": "cpu"}})) as engine:
        api = FastAPI()
        add_openai_routes(api, InlineRunner(engine))
        with TestClient(api) as http:
            yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http), engine


def test_models_and_a_completion_with_logprobs(client):
    oai, engine = client
    assert [m.id for m in oai.models.list().data] == ["reference_lm"]
    out = oai.completions.create(model="reference_lm", prompt=[1, 2, 3], max_tokens=6, temperature=0, logprobs=1)
    [want] = engine.step({"prompts": [[1, 2, 3]], "max_tokens": 6})
    choice = out.choices[0]
    assert choice.token_ids == want.token_ids and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in want.token_ids]
    lp = score(full_weights(ReferenceLMConfig(seed=0)), [1, 2, 3], want.token_ids)
    assert (torch.tensor(choice.logprobs.token_logprobs) - lp).abs().max() <= 1e-5
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 6


def test_streamed_completion_yields_the_same_tokens(client):
    oai, engine = client
    [want] = engine.step({"prompts": [[4, 5]], "max_tokens": 5, "seed": 3, "temperature": 0.7, "top_p": 1.0})
    events = list(oai.completions.create(model="reference_lm", prompt=[4, 5], max_tokens=5, temperature=0.7,
                                         seed=3, stream=True, logprobs=0))
    tokens = [t for e in events for c in e.choices for t in c.token_ids]
    assert tokens == want.token_ids and events[-1].choices[0].finish_reason == "length"


def test_errors_come_in_openais_shape(client):
    oai, _ = client
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        oai.completions.create(model="reference_lm", prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="reference_lm", prompt=[1, 999], max_tokens=4)
    assert info.value.body["type"] == "invalid_request_error" and "999" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.completions.create(model="gpt-4", prompt=[1], max_tokens=4)


def test_an_oversized_prompt_is_refused_before_it_is_copied(client):
    import tracemalloc

    oai, _ = client
    prompt = [1] * 50_000  # times n=64: 3.2 M ids (~26 MB of lists) if copied first
    tracemalloc.start()
    try:
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model="reference_lm", prompt=prompt, max_tokens=4, n=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2 ** 20, f"refusing it allocated {peak / 2 ** 20:.1f} MiB"
    assert "50004" in info.value.body["message"] and "256" in info.value.body["message"], info.value.body
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match=r"n \(64\) x prompt ids \(1024 prompt\(s\), longest 128: "
                                                     r"131072\) = 8388608 exceeds 4194304; lower n"):
        oai.completions.create(model="reference_lm", prompt=[[1] * 128] * 1024, max_tokens=4, n=64)


def test_a_client_that_disconnects_mid_stream_frees_its_sequence_at_the_next_iteration():
    """A real HTTP server (uvicorn, in this process): the client reads three events and hangs up."""
    import threading
    import time

    import uvicorn

    from tests.helpers import free_port, wait_until

    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0, "max_seq": 4096}, config={"device": {"target": "cpu"}})
    with Engine(args) as engine:
        api = FastAPI()
        add_openai_routes(api, InlineRunner(engine))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            wait_until(lambda: server.started, 20, "the HTTP server")
            oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
            stream = oai.completions.create(model="reference_lm", prompt=[1, 2, 3], max_tokens=4000, temperature=0,
                                            stream=True)
            events = [next(iter(stream)) for _ in range(3)]
            assert all(e.choices[0].token_ids for e in events)
            assert engine.batch_stats()[0]["running_sequences"] == 1
            stream.close()  # the connection goes; the sequence has thousands of tokens to go
            closed = time.monotonic()
            wait_until(lambda: engine.batch_stats()[0]["running_sequences"] == 0, 5, "the sequence dropped",
                       interval_s=0.01)
            assert time.monotonic() - closed < 2.0
            status = engine.replica_status()[0]
            assert status.in_flight == 0 and status.served == 0 and status.healthy
        finally:
            server.should_exit = True
            thread.join(timeout=10)


def test_a_stream_interval_groups_writes_and_keeps_every_token(client):
    _, engine = client
    api = FastAPI()
    add_openai_routes(api, InlineRunner(engine), ServeOptions(stream_interval=4))
    [want] = engine.step({"prompts": [[6, 7]], "max_tokens": 10})
    with TestClient(api) as http:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        events = list(oai.completions.create(model="reference_lm", prompt=[6, 7], max_tokens=10, temperature=0,
                                             stream=True))
    assert [t for e in events for c in e.choices for t in c.token_ids] == want.token_ids
    assert events[-1].choices[0].finish_reason == "length"


def test_a_completion_takes_x_request_deadline_ms(client):
    oai, engine = client
    out = oai.completions.create(model="reference_lm", prompt=[1, 2], max_tokens=2, temperature=0,
                                 extra_headers={"X-Request-Deadline-Ms": "30000"})
    assert len(out.choices[0].token_ids) == 2
    with pytest.raises(openai.BadRequestError, match="X-Request-Deadline-Ms='soon'"):
        oai.completions.create(model="reference_lm", prompt=[1], max_tokens=2, extra_headers={"X-Request-Deadline-Ms": "soon"})
    seen = []
    original = engine.submit
    engine.submit = lambda request, *a, **kw: seen.append(kw.get("deadline_s")) or original(request, *a, **kw)
    try:
        oai.completions.create(model="reference_lm", prompt=[1], max_tokens=1, extra_headers={"X-Request-Deadline-Ms": "5000"})
    finally:
        del engine.submit
    assert seen and 4.9 < seen[0] <= 5.0
