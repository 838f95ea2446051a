"""Server-sent event streams of the OpenAI route: a client that disconnects stops the generation at
once (not at garbage collection), and slow streams hold no thread of the event loop's default pool.

The route runs on a real inline engine of `tests/plugins/slow_tokens.py`; the app is driven as an
ASGI server drives it (ASGI spec 2.3: the server reports `http.disconnect`, Starlette cancels the
response), without a network.

Run: `.venv/bin/pytest tests/test_openai_streams.py`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

import pytest
from fastapi import FastAPI

from phyai_ray import Engine, EngineArgs
from phyai_ray.serve.protocols.openai.api import add_openai_routes
from tests.plugins.slow_tokens import SlowTokens, SlowTokensEntry
from tests.test_openai_api import InlineRunner

_SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
          "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
          "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
          "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80)}


@pytest.fixture(scope="module")
def app():
    args = EngineArgs(plugin=SlowTokensEntry, plugin_args={"delay_s": 0.2}, config={"device": {"target": "cpu"}})
    with Engine(args) as engine:
        api = FastAPI()
        add_openai_routes(api, InlineRunner(engine))
        yield api, engine


async def _stream(api, events_before_leaving: int, body: dict) -> float:
    """Read `events_before_leaving` events of a streamed completion, then disconnect; when it left."""
    state = {"sent": False, "events": 0, "left": 0.0}
    leave = asyncio.Event()

    async def receive():
        if not state["sent"]:
            state["sent"] = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await leave.wait()
        state["left"] = time.monotonic()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            state["events"] += message["body"].count(b"data: ")
            if state["events"] >= events_before_leaving:
                leave.set()

    await asyncio.wait_for(api(dict(_SCOPE), receive, send), 30)
    return state["left"]


def _ended(count: int, timeout_s: float) -> list:
    with SlowTokens.ended_changed:
        SlowTokens.ended_changed.wait_for(lambda: len(SlowTokens.ended) >= count, timeout_s)
        return list(SlowTokens.ended)


def test_a_cancelled_stream_stops_the_generation_at_once(app):
    """The response task is cancelled while a pull waits for the next token (a server's disconnect)."""
    from phyai_ray.serve.protocols.openai.api import CompletionChunks, CompletionRequest, plugin_request, sse

    api, engine = app
    SlowTokens.ended.clear()
    request = CompletionRequest.model_validate({"prompt": [1, 2], "max_tokens": 200, "stream": True})

    async def leave_early():
        plugin = plugin_request(request)
        events = sse(InlineRunner(engine), plugin, CompletionChunks(request, "slow_tokens", None, 1))
        await events.__anext__()
        pull = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.05)  # inside the pull: the generation waits for its next token
        pull.cancel()
        left = time.monotonic()
        await asyncio.gather(pull, return_exceptions=True)
        await events.aclose()
        return pull, left

    gc.disable()  # what a server keeps (the task, its exception) must not be what ends the stream
    try:
        task, left = asyncio.run(leave_early())
        ended = _ended(1, 5)
        stopped_after = time.monotonic() - left
    finally:
        gc.enable()
    assert task.cancelled(), f"leaving the stream raised {task.exception()!r}"
    assert ended and ended[0][1] and stopped_after < 2, f"the generation was not stopped: {ended}"
    assert engine.replica_status()[0].in_flight == 0


def test_a_client_that_disconnects_stops_the_generation_at_once(app):
    api, engine = app
    SlowTokens.ended.clear()
    gc.disable()  # a stream left to the garbage collector would hold its slot until the next collection
    try:
        left = asyncio.run(_stream(api, 2, {"prompt": [1, 2], "max_tokens": 200, "stream": True}))
        ended = _ended(1, 5)
        stopped_after = time.monotonic() - left
    finally:
        gc.enable()
    assert ended and ended[0][1], f"the generation was not stopped: {ended}"
    assert ended[0][0] < 10 and stopped_after < 5
    assert engine.replica_status()[0].in_flight == 0


def test_slow_streams_hold_no_default_executor_thread(app):
    api, _ = app
    SlowTokens.ended.clear()
    streams_n = 12  # twice the default pool of a 2-core machine (min(32, cores + 4))

    async def many() -> float:
        body = {"prompt": [1], "max_tokens": 3, "stream": True}
        streams = [asyncio.create_task(_stream(api, 20, body)) for _ in range(streams_n)]
        await asyncio.sleep(0.5)  # every stream waits for its next token now
        started = time.monotonic()
        await asyncio.to_thread(threading.current_thread)
        waited = time.monotonic() - started
        await asyncio.gather(*streams)
        return waited

    assert asyncio.run(many()) < 0.5, "slow streams held every thread of the default pool"
    assert len(_ended(streams_n, 10)) == streams_n


def test_a_stream_a_failed_group_never_started_is_read_from_another_group():
    """Two real engines behind two group runners: the first one's engine is closed (as a failed group
    refuses at open), so its streamed completion is forwarded and read from the second, with the
    same tokens as the second serves directly; after MAX_HOPS failed groups the cause is the answer."""
    from fastapi.testclient import TestClient

    from phyai_ray.errors import EngineUnavailableError
    from phyai_ray.serve.runtime.registry import failed_here, set_failed
    from phyai_ray.serve.runtime.runner import MAX_HOPS

    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0}, config={"device": {"target": "cpu"}})
    with Engine(args) as healthy:
        peer = InlineRunner(healthy)
        peer.group = "peer"
        hops_seen = []

        async def forward_stream(request, hops, failed):
            hops_seen.append((hops, failed))
            async for items in peer.stream(request, hops=hops, failed=failed):
                yield items
        failed_engine = Engine(args)
        failed_engine.close()
        broken = InlineRunner(failed_engine)
        broken.group, broken.forward_stream = "broken", forward_stream
        api = FastAPI()
        add_openai_routes(api, broken)
        body = {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "stream": True}
        try:
            with TestClient(api) as http:
                reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200
            events = [json.loads(line[6:]) for line in reply.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert not [e for e in events if "error" in e], events
            tokens = [t for e in events for c in e["choices"] for t in c["token_ids"]]
            want = healthy.step({"prompts": [[1, 2, 3]], "max_tokens": 5, "temperature": 0})[0].token_ids
            assert tokens == want and hops_seen == [(1, ("broken",))] and failed_here("broken")

            async def read_all(**kw):
                return [i async for i in broken.stream({"prompts": [[1]], "max_tokens": 2}, **kw)]
            with pytest.raises(EngineUnavailableError):  # no more hops: the group's own refusal
                asyncio.run(read_all(hops=MAX_HOPS))
            assert len(hops_seen) == 1
        finally:
            set_failed("broken", False)
