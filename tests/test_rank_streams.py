"""A stream left early by its consumer leaves nothing behind on the output rank of a Ray replica.

Run: `.venv/bin/pytest tests/test_rank_streams.py` (starts one local Ray instance for the session).
"""

from __future__ import annotations

import pytest


@pytest.mark.ray
def test_a_stream_left_early_leaves_no_buffer_on_the_output_rank(ray_session):
    import time

    import ray

    from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                           EngineArgs, EngineConfig, ParallelConfig)

    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))
    with Engine(args, DeploymentConfig(mode="local", cpus_per_rank=0.5)) as engine:
        executor = engine._executors[0]
        output = executor.ranks.actor(executor.ranks.output_rank)
        held = lambda: ray.get(output.__ray_call__.remote(lambda rank: len(rank._streams)), timeout=10)  # noqa: E731
        for _ in range(3):
            chunks = engine.stream({"prompts": [[1, 2, 3]], "max_tokens": 200})
            next(chunks)
            chunks.close()  # cancels: every rank stops at the same step
        assert engine.step({"prompts": [[1, 2]], "max_tokens": 2})  # the cancelled streams have ended
        deadline = time.monotonic() + 5
        while held() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held() == 0, f"{held()} stream buffer(s) left on the output rank"


def test_a_cancel_that_arrives_after_the_stream_ended_leaves_no_sink():
    """The output rank's side of a stream, in this process (the actor class itself, no Ray): a cancel
    that reaches the rank after the stream finished and was read must not create a sink nobody closes;
    one that reaches it before the stream started stops it at its first chunk."""
    import asyncio

    from actors.rank_actor import RankActor
    from phyai_ray.config.engine import DeviceConfig
    from phyai_ray.config.parallel import ParallelConfig
    from phyai_ray.executors.inline import build_inline_runner
    from tests.plugins.slow_tokens import SlowTokensEntry

    rank = RankActor()
    rank._runner = build_inline_runner(SlowTokensEntry(), {"delay_s": 0.0}, ParallelConfig(), DeviceConfig(target="cpu"))
    request = {"prompts": [[1]], "max_tokens": 3}
    out, _ = rank._run(0, "stream", (request, 8))
    assert len(out[0].token_ids) == 3

    async def read_to_end(seq: int) -> list:
        chunks, done = [], False
        while not done:
            got, done = await rank.read_stream(seq, 100, 1.0)
            chunks += got
        return chunks
    assert len(asyncio.run(read_to_end(0))) == 3 and rank._streams == {}
    asyncio.run(rank.cancel_stream(0))  # late: the stream is over and its buffer forgotten
    assert rank._streams == {}, "a late cancel recreated the stream's buffer"
    asyncio.run(rank.cancel_stream(1))  # early: before the stream starts
    out, _ = rank._run(1, "stream", (request, 8))
    assert len(out[0].token_ids) == 0 and rank._streams == {}
