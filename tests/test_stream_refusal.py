"""A stream of a plugin that cannot stream is refused with a clear error, never hangs, and never rides in a
batch of steps (its payload is a request and a chunk sink, which a `step_batch` cannot take).

Before: the rank raised before it closed the stream's sink, so the reader waited forever (a hang of
`/v1/step/stream` on reference_dit), and with batching on the stream was batched with the steps queued
beside it, failing them with a TypeError from `step_batch`.
"""

from __future__ import annotations

import time

import pytest
import torch

from phyai_ray import Engine, EngineArgs, StreamNotSupportedError
from phyai_ray.models.reference_dit import ReferenceDiTEntry

CPU = {"device": {"target": "cpu"}}


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineArgs(plugin=ReferenceDiTEntry({}), plugin_args={"seed": 0}, config=CPU)) as engine:
        yield engine


def test_a_stream_of_a_step_plugin_is_refused_at_once(engine):
    started = time.monotonic()
    with pytest.raises(StreamNotSupportedError, match="cannot stream; send the request as a step"):
        list(engine.stream({"tokens": [[1, 2]]}, timeout=30))
    assert time.monotonic() - started < 10, "the refusal must come at once, not after a timeout"
    assert engine.step({"tokens": [[1, 2]]}).shape[0] == 1  # the replica serves on


def test_a_stream_queued_among_steps_is_not_batched_with_them(engine):
    engine.pause(mode="keep")  # everything queues: one batch would form from the queue at resume
    steps = [engine.submit({"tokens": [[1, k + 1]]}) for k in range(4)]
    future, reader = engine.open_stream({"tokens": [[3, 4]]})
    more = [engine.submit({"tokens": [[2, k + 1]]}) for k in range(4)]
    engine.resume()
    for f in steps + more:
        assert isinstance(f.result(timeout=60), torch.Tensor)  # no TypeError from step_batch
    with pytest.raises(StreamNotSupportedError):
        future.result(timeout=60)
    assert reader.read(5.0)[1], "the stream's reader ends with its request"
