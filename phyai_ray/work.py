"""`Kind`: what one unit of work a replica sends to its ranks is, and the one place each kind runs.

    Kind.STEP     one request: `model.step(request)`
    Kind.BATCH    several requests as one step: `model.step_batch(requests)` (one result each)
    Kind.ITERATE  one iteration of the continuous-batching loop: an `IterationPlan`
    Kind.STREAM   one request whose partial outputs go to a sink: `model.stream(request, emit)`
    Kind.CALL     a collective_rpc: a public method of the per-rank model, (method, args, kwargs)

Every executor (inline, Ray replica, torchrun) queues work of these kinds, and every rank runs it
through `RankRunner.execute(kind, payload, sink)` (phyai_ray/worker.py), so a kind means one thing
everywhere. A `str` enum: a kind travels (pickled, in a lane frame) as its plain name.
"""

from __future__ import annotations

from enum import Enum


class Kind(str, Enum):
    STEP = "step"
    BATCH = "batch"
    ITERATE = "iterate"
    STREAM = "stream"
    CALL = "call"

    def __str__(self) -> str:
        return self.value


REQUEST_KINDS = frozenset({Kind.STEP, Kind.STREAM})  # counted as requests; a CALL (collective_rpc) is not
