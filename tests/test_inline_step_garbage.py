"""The inline fast path (`Engine.step` run on the caller's thread) leaves no reference cycle behind.

A cycle per step (the future holding its work, the work holding its future) is freed only by the
cyclic garbage collector, whose passes then land in a robot loop's step times; these tests pin
that a step run on the caller's thread is freed by reference counting alone, and that it still
answers and counts as before.
"""

from __future__ import annotations

import gc
import weakref

import torch

from phyai_ray import Engine, EngineArgs
from phyai_ray.executors.futures import HereResult
from tests.plugins.tiny import reference

CPU = {"device": {"target": "cpu"}}


def test_a_step_run_here_is_freed_without_the_cyclic_collector():
    x = torch.ones(2, 8)
    with Engine(EngineArgs(plugin="tiny_row_tp", config=CPU)) as engine:
        replica = engine._executors[0]
        engine.step({"x": x})  # warm: the caller's thread runs the next one
        gc.disable()
        try:
            future = replica.submit({"x": x}, caller_runs=True)
            assert isinstance(future, HereResult), ("nothing was queued or running: the caller's thread "
                                                    f"should have run it, got a {type(future).__name__}")
            assert future.done(), "a step run on the caller's thread is settled when submit returns"
            assert torch.equal(future.result(timeout=10), reference(x))
            gone = weakref.ref(future)
            del future
            assert gone() is None, "the step's future is still referenced (a future <-> work cycle)"
        finally:
            gc.enable()
        status = engine.replica_status()[0]
    assert status.served == 2 and status.in_flight == 0


def test_many_steps_leave_no_garbage_for_the_collector():
    x = torch.ones(2, 8)
    with Engine(EngineArgs(plugin="tiny_row_tp", config=CPU)) as engine:
        engine.step({"x": x})
        gc.collect()
        gc.disable()
        try:
            for _ in range(200):
                engine.step({"x": x})
            found = gc.collect()
        finally:
            gc.enable()
        assert engine.replica_status()[0].served == 201
    assert found == 0, f"200 inline steps left {found} objects only the cyclic collector could free"
