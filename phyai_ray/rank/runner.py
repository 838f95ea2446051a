"""What one rank does, whoever hosts it (the caller's thread, a torchrun process, a Ray actor).

`RankRunner` owns the plugin's per-rank model and runs its `step` and public methods with the
rank's named groups active; `init_distributed` forms the replica's torch.distributed world and
its named groups. Ray is not imported here.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

from phyai_ray.errors import StreamNotSupportedError
from phyai_ray.process_groups import GroupSet, activate_groups, deactivate_groups
from phyai_ray.plugins.context import RankContext
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.iteration import RankTiming
from phyai_ray.rank import heap
from phyai_ray.rank.failures import admit_each, agree_admissions, answer, iterate_once
from phyai_ray.work import BATCH, CALL, ITERATE, STEP, STREAM, Kind
from placement.topology import Topology

logger = logging.getLogger(__name__)


def backend_for(device_type: str) -> str:
    """gloo for CPU ranks; NCCL for CUDA (with gloo kept for CPU tensors)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def init_distributed(topology: Topology, rank: int, device_type: str, init_method: str,
                     timeout_s: float) -> GroupSet:
    """Join the replica's world (collective over all its ranks) and build its named groups.

    `timeout_s` is the collective timeout of the world and of every named group.
    """
    import torch.distributed as dist

    if topology.world_size == 1:
        return GroupSet(topology, 0)
    backend = backend_for(device_type)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                world_size=topology.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    elif dist.get_world_size() != topology.world_size or dist.get_rank() != rank:
        raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, but this replica needs rank {rank} of {topology.world_size}")
    return GroupSet.build(topology, rank, backend, timeout_s)


def destroy_distributed() -> None:
    """Tear down every process group of this process, if any."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class RankRunner:
    """The plugin model of one rank, run with that rank's groups active."""

    def __init__(self, entry: Entry, plugin_args: dict[str, Any], ctx: RankContext) -> None:
        self.entry, self.ctx = entry, ctx
        self._control: Any = None
        self._output_rank = ctx.groups.topology.output_rank
        with ctx.groups.activate():
            self.model = entry.create(plugin_args, ctx)
        if not callable(getattr(self.model, "step", None)):
            raise TypeError(f"plugin {entry.display_name()}: create() returned {type(self.model).__name__}, "
                            "which has no step(request) method")
        heap.hold()  # the imports and the model: later collections skip them (heap.py)

    def execute(self, kind: Any, payload: Any, sink: Any = None) -> Any:
        """Run one unit of work of `kind` (phyai_ray.work.Kind): the one entry every executor's ranks
        call; the output rank returns the result, the others None. `sink` is a STREAM's chunk sink."""
        if kind == STEP:
            return self.step(payload)
        if kind == BATCH:
            return self.step_batch(payload)
        if kind == ITERATE:
            return self.iterate(payload)
        if kind == STREAM:
            return self.stream(payload, sink)
        if kind == CALL:
            method, args, kwargs = payload
            return self.call(method, args, kwargs)
        raise ValueError(f"unknown work kind {kind!r}; one of {[k.value for k in Kind]}")

    def step(self, request: Any) -> Any:
        """Run one request; the output rank returns the result, the others None."""
        if self._control is not None:  # the per-step path: the check's call only when there is control
            self._check_awake("a request")
        token = activate_groups(self.ctx.groups)  # `with groups.activate()` without its three calls
        try:
            out = self.model.step(request)
        finally:
            deactivate_groups(token)
        return out if self.ctx.rank == self._output_rank else None

    def _check_awake(self, what: str) -> None:
        if self._control is not None and self._control.asleep_level:
            raise RuntimeError(f"rank {self.ctx.rank} received {what} while asleep (level "
                               f"{self._control.asleep_level}); wake_up() must come first")

    @property
    def batchable(self) -> bool:
        """Whether the per-rank model can run several requests as one step (`step_batch`)."""
        return callable(getattr(self.model, "step_batch", None))

    def step_batch(self, requests: list) -> list | None:
        """Run several requests as one step; the output rank returns one result (or exception) per request.

        The one check of what a plugin's step_batch returned: a list of the wrong length becomes
        one TypeError per request (every rank ran the step, so the replica stays consistent and only
        these requests fail); executors hand the list out member by member as it is."""
        self._check_awake("a batch")
        with self.ctx.groups.activate():
            out = self.model.step_batch(list(requests))
        if not self.ctx.is_output_rank:
            return None
        if isinstance(out, tuple):
            out = list(out)
        if not isinstance(out, list) or len(out) != len(requests):
            got = f"{len(out)} item(s)" if isinstance(out, list) else type(out).__name__
            error = TypeError(f"plugin {self.entry.display_name()}: step_batch of {len(requests)} request(s) returned "
                              f"{got}; it must return a list with one result (or exception) per request, in order")
            return [error] * len(requests)
        return out

    @property
    def iterative(self) -> bool:
        """Whether the per-rank model implements the iteration protocol (admit, drop, recompute, iterate)."""
        from phyai_ray.plugins.iteration import is_iterative

        return is_iterative(self.model)

    def iterate(self, plan: Any) -> Any:
        """Apply one `IterationPlan` (drops, rebuilds, admissions, then turns: pauses and resumes) and
        run ONE iteration; the output rank returns a `RankIteration` (its deltas, the sequences that
        failed alone), the others one only when some sequence failed alone here, else None."""
        self._check_awake("an iteration")
        model = self.model
        started = time.perf_counter()
        with self.ctx.groups.activate():
            for ident in plan.drop:
                model.drop(ident)
            for ident in plan.recompute:
                model.recompute(ident)
            failed = admit_each(model, plan.admit)  # a sequence whose admit raised fails alone (rank/failures.py)
            if self.ctx.world_size > 1 and plan.admit:  # ... on every rank alike
                agree_admissions(model, plan.admit, failed, self.ctx.device)
            if plan.pause or plan.resume:
                self._take_turns(plan)
            planned = time.perf_counter()
            out = iterate_once(model, [ident for ident, _ in plan.admit], failed, self.ctx.world_size == 1)
        reply = answer(out, failed, self.ctx.is_output_rank)  # a RankIteration; None: nothing to say
        if reply is not None:  # where the time went (executors/loop_timing.py)
            reply.timing = RankTiming(planned - started, time.perf_counter() - planned, getattr(out, "forward_s", None))
        return reply

    def _take_turns(self, plan: Any) -> None:
        """The plan's pauses, then its resumes (`IterationPlan`); a model without pause_sequence was
        given an admission policy with turns it cannot take: a TypeError naming both."""
        pause, resume = getattr(self.model, "pause_sequence", None), getattr(self.model, "resume_sequence", None)
        if not (callable(pause) and callable(resume)):
            raise TypeError(f"plugin {self.entry.display_name()}: its admission policy takes turns (Turns), but "
                            f"per-rank model {type(self.model).__name__} has no pause_sequence(seq_id) / "
                            "resume_sequence(seq_id); delegate them to its stepwise Running, or admit without Turns")
        for ident in plan.pause:
            pause(ident)
        for ident in plan.resume:
            resume(ident)

    def stream(self, request: Any, sink: Any) -> Any:
        """Run one request with the model's `stream(request, emit)`, chunks going to `sink` (output rank)."""
        fn = getattr(self.model, "stream", None)
        from phyai_ray.streams import collective_emit

        try:  # the sink closes whatever happens, so its reader ends (with the error) instead of waiting
            if not callable(fn):
                raise StreamNotSupportedError(
                    f"plugin {self.entry.display_name()}: per-rank model {type(self.model).__name__} has no "
                    "stream(request, emit) method: it cannot stream; send the request as a step (Engine.step, "
                    "POST /v1/step)")
            with self.ctx.groups.activate():
                out = fn(request, collective_emit(sink, self.ctx))
        finally:
            if sink is not None:
                sink.close()
        return out if self.ctx.is_output_rank else None

    def control(self, op: str, args: tuple = ()) -> Any:
        """A control-lane operation (pause, sleep, weight update, ...; see `phyai_ray.rank.control`)."""
        if self._control is None:
            from phyai_ray.rank.control import RankControl

            self._control = RankControl(self.model, self.ctx, self.entry.display_name())
        with self.ctx.groups.activate():
            return self._control.run(op, args)

    def call(self, method: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Call a public method of the per-rank model (collective_rpc)."""
        fn = getattr(self.model, method, None) if not method.startswith("_") else None
        if not callable(fn):
            raise AttributeError(f"plugin {self.entry.display_name()}: per-rank model "
                                 f"{type(self.model).__name__} has no public method {method!r}")
        with self.ctx.groups.activate():
            return fn(*args, **(kwargs or {}))


def make_context(*, topology: Topology, groups: GroupSet, rank: int, replica_index: int, device: Any,
                 dtype: Any, parallel: Any, local_rank: int = 0, node_id: str | None = None) -> RankContext:
    return RankContext(rank=rank, world_size=topology.world_size, replica_index=replica_index, device=device,
                       dtype=dtype, parallel=parallel, groups=groups, local_rank=local_rank, node_id=node_id)
