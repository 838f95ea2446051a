"""Deadlines on the OpenAI routes, through the real `openai` client: `X-Request-Deadline-Ms` and the
body's `deadline_ms` (an extension) on completions and chat completions, streamed and not.

Run: .venv/bin/pytest tests/test_openai_deadlines.py -q

Completions run on an inline `reference_lm` engine, chat on a tiny Qwen2-shaped `hf_causal_lm`
checkpoint (transformers writes it), each in a FastAPI app reached through `TestClient` (no Ray,
no Serve). What the engine was given is read by wrapping its `submit` / `open_stream`; a hopeless
deadline is made by recording slow iterations into the loop's estimate (`ServiceTime`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from phyai_ray import Engine, EngineArgs
from phyai_ray.executors.service import ServiceTime
from phyai_ray.serve.protocols.openai.api import add_openai_routes
from tests.test_openai_api import InlineRunner

openai = pytest.importorskip("openai")
CHAT = [{"role": "user", "content": "Hi"}]


def served(engine: Engine) -> tuple[Any, TestClient]:
    api = FastAPI()
    add_openai_routes(api, InlineRunner(engine))
    http = TestClient(api)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0), http


@pytest.fixture(scope="module")
def lm():
    with Engine(EngineArgs(plugin="reference_lm", plugin_args={"seed": 0}, config={"device": {"target": "cpu"}})) as engine:
        oai, http = served(engine)
        with http:
            yield oai, http, engine


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_checkpoints import write_checkpoint

    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-qwen2", "qwen2")
    with Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                           config={"device": {"target": "cpu"}})) as engine:
        oai, http = served(engine)
        with http:
            yield oai, engine


@contextlib.contextmanager
def given(engine: Engine, method: str) -> Iterator[list]:
    """The `deadline_s` each call of `engine.<method>` received while inside."""
    seen: list = []
    original = getattr(engine, method)
    setattr(engine, method, lambda *a, **kw: seen.append(kw.get("deadline_s")) or original(*a, **kw))
    try:
        yield seen
    finally:
        delattr(engine, method)


@contextlib.contextmanager
def slow_iterations(engine: Engine, seconds: float) -> Iterator[None]:
    """The loop's estimate says every iteration takes `seconds` while inside; a fresh one after."""
    loop = engine._executors[0].queue
    for _ in range(32):
        loop.service.record(seconds)
    try:
        yield
    finally:
        loop.service = ServiceTime()


# -- completions --------------------------------------------------------------------------------------

def test_completions_take_deadline_ms_in_the_body_and_the_earlier_of_body_and_header(lm):
    oai, _, engine = lm
    with given(engine, "submit") as seen:
        out = oai.completions.create(model="reference_lm", prompt=[1, 2], max_tokens=2, extra_body={"deadline_ms": 5000})
        oai.completions.create(model="reference_lm", prompt=[1], max_tokens=1, extra_body={"deadline_ms": 5000},
                               extra_headers={"X-Request-Deadline-Ms": "2000"})
    assert len(out.choices[0].token_ids) == 2
    assert 4.9 < seen[0] <= 5.0 and 1.9 < seen[1] <= 2.0, seen
    with pytest.raises(openai.BadRequestError, match="deadline_ms='soon'") as info:
        oai.completions.create(model="reference_lm", prompt=[1], max_tokens=2, extra_body={"deadline_ms": "soon"})
    assert info.value.body["param"] == "deadline_ms"


def test_a_completion_that_cannot_finish_by_its_deadline_is_a_504_at_once(lm):
    oai, _, engine = lm
    with slow_iterations(engine, 0.5), pytest.raises(openai.APIStatusError) as info:
        oai.completions.create(model="reference_lm", prompt=[1], max_tokens=4, extra_body={"deadline_ms": 1000})
    assert info.value.status_code == 504 and info.value.body["type"] == "deadline_missed"
    assert "4 iteration(s) of about 500.0 ms" in info.value.body["message"]  # max_tokens x the iteration time


def test_a_streamed_completion_gives_its_deadline_to_the_stream(lm):
    oai, _, engine = lm
    with given(engine, "open_stream") as seen:
        events = list(oai.completions.create(model="reference_lm", prompt=[4, 5], max_tokens=3, stream=True,
                                             extra_headers={"X-Request-Deadline-Ms": "3000"}))
    assert len([t for e in events for c in e.choices for t in c.token_ids]) == 3
    assert len(seen) == 1 and 2.9 < seen[0] <= 3.0, seen


def test_a_stream_without_its_first_chunk_in_time_ends_with_an_error_event(lm):
    oai, http, engine = lm
    with slow_iterations(engine, 0.5):
        with pytest.raises(openai.APIError, match="first chunk") as info:
            list(oai.completions.create(model="reference_lm", prompt=[1], max_tokens=3, stream=True,
                                        extra_body={"deadline_ms": 100}))
        assert info.value.body["code"] == 504
        raw = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 3, "stream": True, "deadline_ms": 100})
    assert raw.status_code == 200  # the event says it: the response had started (see serve/protocols/openai/common.py)
    events = [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]
    assert '"code": 504' in events[0] and events[-1] == "[DONE]" and len(events) == 2


# -- chat completions ---------------------------------------------------------------------------------

def test_chat_takes_the_header_and_the_body_field(chat):
    oai, engine = chat
    with given(engine, "submit") as seen:
        out = oai.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=3, temperature=0,
                                          extra_headers={"X-Request-Deadline-Ms": "4000"})
        oai.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=3, extra_body={"deadline_ms": 6000})
    assert out.choices[0].message.content is not None
    assert 3.9 < seen[0] <= 4.0 and 5.9 < seen[1] <= 6.0, seen
    with given(engine, "open_stream") as seen:
        chunks = list(oai.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=3, stream=True,
                                                  extra_body={"deadline_ms": 3000}))
    assert chunks and 2.9 < seen[0] <= 3.0, seen
    with pytest.raises(openai.BadRequestError, match="X-Request-Deadline-Ms='-5'"):
        oai.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=3,
                                    extra_headers={"X-Request-Deadline-Ms": "-5"})


def test_chat_deadlines_that_cannot_be_met_are_answered_as_missed(chat):
    oai, engine = chat
    with slow_iterations(engine, 0.5):
        with pytest.raises(openai.APIStatusError) as info:
            oai.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=8, extra_body={"deadline_ms": 2000})
        assert info.value.status_code == 504 and "8 iteration(s)" in info.value.body["message"]
        with pytest.raises(openai.APIError, match="first chunk") as info:
            list(oai.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=8, stream=True,
                                             extra_headers={"X-Request-Deadline-Ms": "100"}))
        assert info.value.body["code"] == 504
    out = oai.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=8, extra_body={"deadline_ms": 2000})
    assert out.usage.completion_tokens >= 1  # the same request fits once iterations are fast again
