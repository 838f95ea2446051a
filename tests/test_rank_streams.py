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
        output = executor.actor(executor._output_rank)
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
