"""Fresh replies on the openpi edge: a frame's `late` (its own field or the connection's query)
reaches the engine, and every reply's `server_timing` says when the server received the frame and
sent the chunk (Unix seconds), its weight version and whether the deadline was met. Without Ray
or sockets: the edge's frame handler against an inline engine.

Run: `.venv/bin/pytest tests/test_fresh_replies.py -q`
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from phyai_ray import Engine, EngineArgs
from phyai_ray.serve.protocols.openpi import _answer, pack, unpack
from phyai_ray.serve.protocols.timing import late_mode

OPTIONS = SimpleNamespace(max_tensor_bytes=1 << 20, overload_status=503)


class Runner:
    """The part of a GroupRunner the openpi edge uses, over an inline engine; it records what it was asked."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.entry, self.group, self.asked = engine, engine.entry, "g0", []

    async def run(self, request, *, forward, deadline_s, timing, late):
        self.asked.append((deadline_s, late))
        future = self.engine.submit(request, deadline_s=deadline_s, late=late)
        value = await asyncio.wrap_future(future)
        timing.update(future.timing())
        return value


@pytest.fixture(scope="module")
def runner():
    with Engine(EngineArgs(plugin="reference_policy")) as engine:
        yield Runner(engine)


def answer(runner, frame: dict, defaults=(None, None)):
    return asyncio.run(_answer(pack(frame), runner, OPTIONS, "r1", defaults))


def test_every_chunk_says_when_it_was_received_and_sent_and_whether_it_was_on_time(runner):
    before = time.time()
    reply, fatal = answer(runner, {"state": np.zeros(8, np.float32), "deadline_ms": 5000})
    timing = unpack(reply, 1 << 20)["server_timing"]
    assert not fatal and before <= timing["received_at"] <= timing["sent_at"] <= time.time()
    assert timing["deadline_met"] is True and "weight_version" in timing


def test_late_comes_from_the_frame_or_the_connection(runner):
    runner.asked.clear()
    answer(runner, {"state": np.zeros(8, np.float32), "deadline_ms": 5000, "late": "drop"})
    answer(runner, {"state": np.zeros(8, np.float32)}, defaults=(2.0, "drop"))
    answer(runner, {"state": np.zeros(8, np.float32), "late": "finish"}, defaults=(2.0, "drop"))
    assert runner.asked == [(5.0, "drop"), (2.0, "drop"), (2.0, "finish")]


def test_a_bad_late_is_refused_with_the_reason(runner):
    reply, fatal = answer(runner, {"state": np.zeros(8, np.float32), "late": "later"})
    assert isinstance(reply, str) and "late='later' must be 'finish'" in reply and not fatal
    with pytest.raises(ValueError, match="the URL's query"):
        late_mode(b"sometimes", "late (the URL's query)")
    assert late_mode(None, "late") is None and late_mode(b"drop", "late") == "drop"


# -- OIP: parameters.late in, received_at / sent_at out ------------------------------------------

def test_oip_takes_late_as_a_parameter_and_reports_freshness():
    import json

    from phyai_ray.serve.protocols.oip import tensors as oc
    from phyai_ray.serve.protocols.oip.routes import parse_infer, respond
    from phyai_ray.serve.runtime.options import ServeOptions
    from tests.test_oip_codec import AnyEntry

    def body(**params):
        return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}],
                           "parameters": params}).encode()

    parsed = parse_infer(body(deadline_ms=100, late="drop"), None, AnyEntry(), ServeOptions())
    assert parsed.late == "drop" and "late" not in parsed.request.request  # not passed to the plugin
    assert parse_infer(body(), None, AnyEntry(), ServeOptions()).late is None
    with pytest.raises(oc.OipError, match="parameters.late='soon'"):
        parse_infer(body(late="soon"), None, AnyEntry(), ServeOptions())
    parsed.timing.update({"queue_ms": 1.0, "infer_ms": 2.0, "deadline_met": True})

    class Group:
        entry = AnyEntry()

    params = json.loads(respond(parsed, [1.0], "m", "r-1", Group()).body)["parameters"]
    assert parsed.received_at <= params["received_at"] <= params["sent_at"] <= time.time()
    assert params["deadline_met"] is True and params["deadline_ms"] == 100


def test_the_example_robot_discards_a_stale_chunk():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "robot_fleet.py"
    spec = importlib.util.spec_from_file_location("robot_fleet_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.stale({"actions": [], "server_timing": {"deadline_met": False}})
    assert not module.stale({"actions": [], "server_timing": {"deadline_met": True}})
    assert not module.stale({"actions": []})  # no deadline given, or a server without timing


# -- forwarding keeps the deadline -----------------------------------------------------------------

def test_a_forwarded_request_carries_what_is_left_of_its_deadline_and_waits_no_longer():
    from phyai_ray.errors import EngineUnavailableError
    from phyai_ray.serve.runtime.registry import set_failed
    from phyai_ray.serve.runtime.holder import EngineHolder
    from phyai_ray.serve.runtime.runner import GroupRunner
    from tests.test_serve_http import StepEngine

    sent = []

    async def forward(request, hops, failed, **deadline):
        sent.append(deadline)
        if deadline.get("late") == "finish":
            await asyncio.sleep(5)  # no healthy group answers
        return {"from": "peer"}

    down = dict(at_submit=EngineUnavailableError("group failed", reason="no_healthy_replica"), healthy=False)
    class Down(StepEngine):
        def submit(self, request, **deadline):  # refuses at once, as a failed group does
            return super().submit(request)

    runner = GroupRunner(EngineHolder(lambda: Down(**down)), group="g7", forward=forward)
    try:
        assert asyncio.run(runner.run({"x": [1.0]}, deadline_s=2.0, late="drop")) == {"from": "peer"}
        assert 1.9 < sent[-1]["deadline_s"] <= 2.0 and sent[-1]["late"] == "drop"
        began = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="within 0s"):  # its 0.2 s deadline, not 30 s
            asyncio.run(runner.run({"x": [1.0]}, deadline_s=0.2, late="finish"))
        assert time.monotonic() - began < 1.0
    finally:
        set_failed("g7", False)


def test_a_forwarded_stream_carries_what_is_left_of_its_first_chunks_deadline():
    from phyai_ray import Engine, EngineArgs
    from phyai_ray.serve.runtime.registry import set_failed
    from phyai_ray.serve.runtime.holder import EngineHolder
    from phyai_ray.serve.runtime.runner import GroupRunner

    sent = []

    async def forward_stream(request, hops, failed, **deadline):
        sent.append(deadline)
        yield [("chunk", {"from": "peer"})]
        yield [("end", None)]

    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0}, config={"device": {"target": "cpu"}})
    failed_engine = Engine(args)
    failed_engine.close()  # refuses every stream at open, as a failed group does
    runner = GroupRunner(EngineHolder(lambda: failed_engine), group="g8", forward_stream=forward_stream)

    async def read(**kw):
        return [item async for items in runner.stream({"prompts": [[1, 2]], "max_tokens": 2}, **kw) for item in items]

    try:
        assert asyncio.run(read(deadline_s=2.0))[0] == ("chunk", {"from": "peer"})
        assert 1.9 < sent[-1]["deadline_s"] <= 2.0
        asyncio.run(read())
        assert sent[-1] == {}  # none given, none invented
    finally:
        set_failed("g8", False)


def test_grpc_takes_the_calls_own_deadline_when_no_parameter_gives_one():
    from phyai_ray.serve.protocols.oip.servicer import call_deadline

    class Call:
        def __init__(self, left):
            self.left = left

        def time_remaining(self):
            return self.left

    assert call_deadline(None, Call(0.25)) == 0.25  # grpc-timeout: 250 ms left
    assert call_deadline(0.1, Call(0.25)) == 0.1  # parameters.deadline_ms wins
    assert call_deadline(None, Call(None)) is None and call_deadline(None, None) is None
