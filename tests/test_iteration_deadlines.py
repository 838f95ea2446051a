"""Deadlines in the iteration loop: finish-by admission from the loop's recent iteration time x a
sequence's planned steps, late="drop" mid-way, a stream's first chunk by its deadline, and a
deadline heap that forgets what it no longer owes.

Run: .venv/bin/pytest tests/test_iteration_deadlines.py -q

Inline engines of the reference flow policy (`SequenceSpec.steps` = its denoising steps) and of
`iter_probe` (no steps: no estimate). The estimate is set by recording iteration times into the
loop's `ServiceTime`, and what happened is read from the loop's own counters (iterations run,
requests admitted), not from wall-clock races.
"""

from __future__ import annotations

import time

import pytest

from phyai_ray import BatchingConfig, DeadlineMissedError, DeploymentConfig, Engine, EngineArgs
from phyai_ray.executors.service import ServiceTime
from phyai_ray.executors.sequences import LoopRequest, finish_by_miss, planned_steps
from phyai_ray.plugins.iteration import SequenceSpec
from tests.plugins.iterating import IterProbeEntry

FRAME = {"state": [0.1] * 8}
PROBE = f"{IterProbeEntry.__module__}:IterProbeEntry"
CPU = {"device": {"target": "cpu"}}


def flow_engine(num_steps: int, **batching) -> Engine:
    return Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={"num_steps": num_steps}),
                  DeploymentConfig(batching=BatchingConfig(**batching)))


def loop_of(engine: Engine):
    """The engine's one iteration loop (the replica's request queue)."""
    loop = engine._executors[0].queue
    assert loop.iterative, "the plugin should run the iteration protocol"
    return loop


def estimate(loop, seconds: float) -> None:
    """Make the loop's recent iteration time `seconds` (a full window of it)."""
    for _ in range(32):
        loop.service.record(seconds)
    assert loop.service.estimate() == pytest.approx(seconds)


# -- the estimate, pure ----------------------------------------------------------------------------

def test_planned_steps_is_the_longest_sequence_and_none_when_any_is_unknown():
    assert planned_steps([SequenceSpec(0, steps=4), SequenceSpec(1, steps=9)], "p") == 9
    assert planned_steps([SequenceSpec(0, steps=4), SequenceSpec(1)], "p") is None
    with pytest.raises(ValueError, match=r"plugin p: SequenceSpec.steps=0 must be an int >= 1"):
        planned_steps([SequenceSpec(0, steps=0)], "p")


def test_finish_by_miss_names_the_estimate_and_the_deadline():
    req = LoopRequest("frame", None, 60.0, None, deadline=None)
    req.deadline, req.steps = req.submitted + 0.100, 8
    assert finish_by_miss(0, req, req.submitted, 0.010) is None  # 80 ms < 100 ms
    error = finish_by_miss(3, req, req.submitted + 0.005, 0.015)  # 5 + 120 ms > 100 ms
    assert isinstance(error, DeadlineMissedError) and error.deadline_s == pytest.approx(0.1)
    assert "replica 3: the request's deadline (100.0 ms) could not be met" in str(error)
    assert "8 iteration(s) of about 15.0 ms here lately (120.0 ms)" in str(error)
    req.steps = None  # unknown steps: only the deadline itself
    assert finish_by_miss(0, req, req.submitted + 0.099, 1.0) is None
    assert "no time left" in str(finish_by_miss(0, req, req.submitted + 0.1, 1.0))


# -- finish-by admission in the loop ---------------------------------------------------------------

def test_a_frame_that_cannot_finish_by_its_deadline_is_answered_at_once():
    with flow_engine(10) as engine:
        loop = loop_of(engine)
        engine.step(FRAME)  # warm
        estimate(loop, 0.020)  # 10 steps x 20 ms = 200 ms
        ran = loop.iterations
        hopeless = engine.submit(FRAME, deadline_s=0.1)
        assert hopeless.done(), "answered in submit, without waiting for the loop"
        with pytest.raises(DeadlineMissedError, match=r"10 iteration\(s\) of about 20.0 ms here lately \(200.0 ms\)"):
            hopeless.result(timeout=0)
        assert loop.iterations == ran and loop.tally.missed == 1
        fine = engine.submit(FRAME, deadline_s=5.0)  # 200 ms fits
        assert fine.result(timeout=30)["actions"].shape[0] > 0
        assert fine.timing()["deadline_met"] is True


def test_a_waiting_frame_whose_estimate_outgrew_its_deadline_never_runs():
    with flow_engine(10, max_num_seqs=1) as engine:
        loop = loop_of(engine)
        engine.step(FRAME)
        estimate(loop, 0.010)  # 100 ms: a 3 s deadline fits at submit
        loop.quiesce("pause", "keep", time.monotonic() + 5)  # held: both wait
        bulk = engine.submit(FRAME)
        robot = engine.submit(FRAME, deadline_s=3.0)  # earliest deadline first: the head
        estimate(loop, 0.500)  # meanwhile iterations got slow: 10 x 500 ms = 5 s > 3 s
        loop.release(None)
        with pytest.raises(DeadlineMissedError, match=r"could not be met: .* 10 iteration\(s\) of about 500.0 ms"):
            robot.result(timeout=30)
        assert robot.work.admitted is False, "it was answered at the head instead of taking the slot"
        assert bulk.result(timeout=30)["actions"].shape[0] > 0


def test_without_planned_steps_only_the_deadline_itself_is_checked():
    with Engine(EngineArgs(plugin=PROBE, config=CPU)) as engine:
        loop = loop_of(engine)
        estimate(loop, 10.0)  # would refuse anything with steps
        [out] = engine.submit({"prompts": [[1, 2]], "max_tokens": 3}, deadline_s=1.0).result(timeout=30)
        assert len(out.token_ids) == 3


# -- late="drop" mid-way ----------------------------------------------------------------------------

def test_late_drop_leaves_mid_way_at_the_next_iteration():
    steps = 1000  # enough that its iterations outlast the deadline floor (50 ms) on a fast, quiet machine
    with flow_engine(steps, max_num_seqs=1) as engine:
        loop = loop_of(engine)
        engine.step(FRAME)  # warm, and the time of one iteration
        per_iteration = loop.service.estimate()
        loop.service = ServiceTime()  # the estimate does not foresee it: it is admitted
        before = loop.iterations
        late = engine.submit(FRAME, deadline_s=max(25 * per_iteration, 0.05), late="drop")
        with pytest.raises(DeadlineMissedError, match="late result was dropped"):
            late.result(timeout=60)
        ran = loop.iterations - before
        assert late.work.admitted and 0 < ran < steps, f"it ran {ran} of its {steps} iterations"
        assert engine.step(FRAME)["actions"].shape[0] > 0  # its slot is free


# -- streams: the first chunk by the deadline -------------------------------------------------------

def test_a_stream_that_cannot_give_a_first_chunk_in_time_is_refused_at_open():
    with Engine(EngineArgs(plugin=PROBE, config=CPU)) as engine:
        estimate(loop_of(engine), 0.5)  # one iteration: 500 ms
        with pytest.raises(DeadlineMissedError, match=r"its first chunk needs 1 iteration\(s\) of about 500.0 ms"):
            next(engine.stream({"prompts": [[1]], "max_tokens": 3}, deadline_s=0.1))
        chunks = list(engine.stream({"prompts": [[1]], "max_tokens": 3}, deadline_s=2.0))  # 500 ms fits
        assert len(chunks) == 3


def test_a_stream_with_no_chunk_by_its_deadline_is_cancelled_before_the_slow_iteration_ends():
    with Engine(EngineArgs(plugin=PROBE, config=CPU)) as engine:
        loop = loop_of(engine)
        began = time.monotonic()
        stream = engine.stream({"prompts": [[1]], "max_tokens": 3, "sleep": 1.0}, deadline_s=0.2)
        with pytest.raises(DeadlineMissedError, match="before its first chunk"):
            next(stream)
        assert loop.iterations == 0, "answered while its first iteration still ran"
        assert time.monotonic() - began < 1.0
        [out] = engine.step({"prompts": [[2]], "max_tokens": 2}, timeout=30)  # the replica serves on
        assert len(out.token_ids) == 2


def test_stream_items_ends_a_stream_with_no_first_chunk_in_time_with_the_missed_error():
    import asyncio

    from phyai_ray.async_streams import stream_items

    async def items(engine: Engine, deadline_s: float) -> list:
        return [item async for got in stream_items(engine, {"prompts": [[1]], "max_tokens": 2, "sleep": 1.0},
                                                    deadline_s=deadline_s) for item in got]

    with Engine(EngineArgs(plugin=PROBE, config=CPU)) as engine:
        [(kind, error)] = asyncio.run(items(engine, 0.2))
        assert kind == "error" and isinstance(error, DeadlineMissedError), (kind, error)
        assert "before its first chunk" in str(error) and loop_of(engine).iterations == 0
        assert [kind for kind, _ in asyncio.run(items(engine, 30.0))] == ["chunk", "chunk", "end"]


def test_a_stream_leaves_the_deadline_heap_with_its_first_chunk():
    with Engine(EngineArgs(plugin=PROBE, config=CPU)) as engine:
        loop = loop_of(engine)
        stream = engine.stream({"prompts": [[1]], "max_tokens": 50, "sleep": 0.01}, deadline_s=3600)
        next(stream)
        assert len(loop._deadlines) == 0 and loop.counts().in_flight == 1  # still running, owed nothing
        assert len(list(stream)) == 49


# -- the heap forgets finished requests ---------------------------------------------------------------

@pytest.mark.parametrize("late", ["finish", "drop"])
def test_many_short_frames_with_long_deadlines_leave_the_heap_small(late):
    with flow_engine(2, max_num_seqs=16) as engine:
        loop = loop_of(engine)
        largest = 0
        for _ in range(6):  # 6 waves of 40 frames, each due in an hour
            wave = [engine.submit(FRAME, deadline_s=3600.0, late=late) for _ in range(40)]
            for future in wave:
                assert future.result(timeout=60)["actions"].shape[0] > 0
            largest = max(largest, len(loop._deadlines._heap))
        assert len(loop._deadlines) == 0, "a finished request stayed on the heap"
        assert largest <= 40 + 64, f"the heap grew with the rate: {largest} entries after 240 requests"
        assert len(loop._deadlines._heap) <= 64
