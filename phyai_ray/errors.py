"""The exception hierarchy of phyai-ray.

Every error derives from `PhyAIError` and mixes in the builtin it behaves
like, so callers may catch either:

    PhyAIError
    ├── ParallelConfigError(ValueError)   topology rejected by config or plugin
    ├── DeploymentConfigError(ValueError) deployment settings that cannot work
    ├── PluginError(LookupError)          a plugin name or import path that does not resolve
    ├── RequestRejectedError(ValueError)  the plugin's validator refused a request; nothing ran
    │   └── GuardrailError                a safety checker refused a request's prompt or its output
    ├── StartupError(RuntimeError)        workers failed or timed out while starting
    ├── EngineUnavailableError(RuntimeError)
    │                                     the backend can no longer serve
    ├── EngineOverloadedError(RuntimeError)
    │                                     every healthy replica's queue is full; the request was
    │                                     not admitted (nothing else is affected): retry later
    ├── RequestTimeoutError(TimeoutError) one request passed its own limit (execution_timeout_s
    │   │                                 from submission, or its estimate); the replica keeps serving
    │   └── DeadlineMissedError           its own deadline (submit(deadline_s=)) passed before it
    │                                     started: answered at once, never run
    ├── RequestAbortedError(RuntimeError) a queued request dropped by pause(mode="abort")
    ├── OutOfMemoryRequestError(MemoryError)
    │                                     one request did not fit in memory; it alone failed
    ├── SleepUnsupportedError(RuntimeError)
    │                                     sleep() of a plugin whose ranks cannot free anything
    ├── StreamNotSupportedError(TypeError) a stream of a plugin whose model has no stream(); use step()
    ├── ReplicaStateError(RuntimeError)   a control call not allowed in the replica's state
    └── WeightUpdateRefusedError(ValueError)
                                          a weight update whose names, shapes or dtypes do not
                                          match the model; nothing was changed
"""

from __future__ import annotations

from typing import Any


class PhyAIError(Exception):
    """Base class of every phyai-ray error."""


class ParallelConfigError(PhyAIError, ValueError):
    """A parallel topology is invalid, or a plugin cannot run it."""


class DeploymentConfigError(PhyAIError, ValueError):
    """Deployment settings (mode, devices, replicas, ports) that cannot work."""


class PluginError(PhyAIError, LookupError):
    """A plugin could not be found or loaded."""


class RequestRejectedError(PhyAIError, ValueError):
    """The plugin's validator refused a request before any rank saw it: nothing ran, nothing changed.

    Raised by `Engine.submit` / `step` / `stream` and by `phyai_ray.validation.validate` (what the
    edges call). The message is the plugin's own, after its name and the validator's exception type:

        plugin reference_dit rejected the request: ValueError: sequence length 65 > max_seq=64

    `__cause__` is the validator's exception, `plugin` the plugin's name and `field` the request
    field at fault when the validator said which (a pydantic error's location, or a `field`
    attribute on its exception), else None. Sending the same request again fails the same way: fix
    the field the message names. The serving edges answer it as the client's fault (see
    `phyai_ray/serve/protocols/error_map.py`: 422 on /v1/step, 400 on OIP and the OpenAI routes).
    """

    def __init__(self, message: str, *, plugin: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.plugin, self.field = plugin, field

    def __reduce__(self):
        return (_rebuild_rejected, (str(self), self.plugin, self.field))


def _rebuild_rejected(message, plugin, field) -> RequestRejectedError:
    return RequestRejectedError(message, plugin=plugin, field=field)


class GuardrailError(RequestRejectedError):
    """A safety checker refused one request (its prompt before any rank, or its output after decode).

    Only that request fails (400 `guardrail`); the message names the checker and why, never the
    prompt or the frames, so it can be logged and returned as it is."""

    def __reduce__(self):
        return (_rebuild_guardrail, (str(self), self.plugin, self.field))


def _rebuild_guardrail(message, plugin, field) -> GuardrailError:
    return GuardrailError(message, plugin=plugin, field=field)


class OutOfMemoryRequestError(PhyAIError, MemoryError):
    """One request ran out of device memory while it was admitted (or, on one rank, in the iteration
    that admitted it): it alone failed, what it took was freed, and the replica keeps serving.

    Answered 503 with reason "out_of_memory": the same request may fit later, beside less work;
    a smaller one (fewer frames, a lower resolution, a shorter prompt) fits sooner. `replica` and
    `request_id` name it when known."""

    def __init__(self, message: str, *, replica: int | None = None, request_id: Any = None) -> None:
        super().__init__(message)
        self.replica, self.request_id = replica, request_id

    def __reduce__(self):
        return (_rebuild_oom, (str(self), self.replica, self.request_id))


def _rebuild_oom(message, replica, request_id) -> OutOfMemoryRequestError:
    return OutOfMemoryRequestError(message, replica=replica, request_id=request_id)


class SleepUnsupportedError(PhyAIError, RuntimeError):
    """`sleep(level)` of a plugin whose per-rank model defines no `sleep(level) -> int` and holds no
    torch module to fall back on: nothing could be freed, so no level is reported. `plugin` names it."""

    def __init__(self, message: str, *, plugin: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin

    def __reduce__(self):
        return (_rebuild_sleep_unsupported, (str(self), self.plugin))


def _rebuild_sleep_unsupported(message, plugin) -> SleepUnsupportedError:
    return SleepUnsupportedError(message, plugin=plugin)


class StartupError(PhyAIError, RuntimeError):
    """A replica failed to start; nothing of it is left running."""

    def __init__(self, message: str, *, replica: int | None = None, rank: int | None = None,
                 node: str | None = None) -> None:
        super().__init__(message)
        self.replica, self.rank, self.node = replica, rank, node


class EngineUnavailableError(PhyAIError, RuntimeError):
    """The backend can no longer serve: a worker died, a deadline passed, or it was closed.

    Attributes name the cause so an owning layer (Ray Serve, an RL loop) can act on it:
    `reason` is one of "closed", "worker_exit", "timeout", "exception", "malformed",
    "no_healthy_replica"; `replica`, `rank` and `node` are filled when known.
    """

    def __init__(self, message: str, *, reason: str = "unavailable", replica: int | None = None,
                 rank: int | None = None, node: str | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.reason, self.replica, self.rank, self.node, self.detail = reason, replica, rank, node, detail

    def __reduce__(self):  # keep attributes across pickling (Ray, multiprocessing)
        return (_rebuild_unavailable, (str(self), self.reason, self.replica, self.rank, self.node, self.detail))


def _rebuild_unavailable(message, reason, replica, rank, node, detail) -> EngineUnavailableError:
    return EngineUnavailableError(message, reason=reason, replica=replica, rank=rank, node=node, detail=detail)


class EngineOverloadedError(PhyAIError, RuntimeError):
    """Every healthy replica's engine-side queue is full: the request was shed, nothing else lost.

    Raised at once by `submit`; the replicas keep serving what they admitted. Retry later, add
    replicas, or raise `WorkerSupervisorConfig.max_queued_requests`. `queued` is the number of
    requests waiting on the replicas that were full, `limit` the per-replica bound.
    """

    def __init__(self, message: str, *, queued: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.queued, self.limit = queued, limit

    def __reduce__(self):
        return (_rebuild_overloaded, (str(self), self.queued, self.limit))


class RequestTimeoutError(PhyAIError, TimeoutError):
    """A request was not finished within its own limit: `execution_timeout_s` after submission
    (queueing included) when that is set, else the hang limit for a step, or, for an iterative
    request, its planned iterations x the recent iteration time, twice, plus the hang limit.

    Only that request fails: a request still queued is dropped before it reaches a rank, and the
    replica stays healthy. (A replica fails as a whole only when ONE rank call has been running on
    its ranks for the hang limit, `rank_call_timeout_s`; that is an `EngineUnavailableError` with
    reason "timeout".)
    """

    def __init__(self, message: str, *, replica: int | None = None, waited_s: float | None = None,
                 dispatched: bool | None = None) -> None:
        super().__init__(message)
        self.replica, self.waited_s, self.dispatched = replica, waited_s, dispatched

    def __reduce__(self):
        return (_rebuild_request_timeout, (str(self), self.replica, self.waited_s, self.dispatched))


class DeadlineMissedError(RequestTimeoutError):
    """A request's own deadline (`Engine.submit(request, deadline_s=)`, `X-Request-Deadline-Ms`, ...)
    passed before it started; it never ran, and the replica keeps serving. `deadline_s` is the
    deadline it was given, `waited_s` how long it waited."""

    def __init__(self, message: str, *, replica: int | None = None, waited_s: float | None = None,
                 deadline_s: float | None = None) -> None:
        super().__init__(message, replica=replica, waited_s=waited_s, dispatched=False)
        self.deadline_s = deadline_s

    def __reduce__(self):
        return (_rebuild_deadline_missed, (str(self), self.replica, self.waited_s, self.deadline_s))


def _rebuild_deadline_missed(message, replica, waited_s, deadline_s) -> DeadlineMissedError:
    return DeadlineMissedError(message, replica=replica, waited_s=waited_s, deadline_s=deadline_s)


def _rebuild_overloaded(message, queued, limit) -> EngineOverloadedError:
    return EngineOverloadedError(message, queued=queued, limit=limit)


def _rebuild_request_timeout(message, replica, waited_s, dispatched) -> RequestTimeoutError:
    return RequestTimeoutError(message, replica=replica, waited_s=waited_s, dispatched=dispatched)


class RequestAbortedError(PhyAIError, RuntimeError):
    """A queued request was dropped by `pause(mode="abort")` before it reached a rank; resubmit it."""

    def __init__(self, message: str, *, replica: int | None = None) -> None:
        super().__init__(message)
        self.replica = replica

    def __reduce__(self):
        return (_rebuild_aborted, (str(self), self.replica))


class StreamNotSupportedError(PhyAIError, TypeError):
    """A streamed request to a plugin whose per-rank model has no `stream(request, emit)` (nor the
    iteration protocol): nothing ran; send it as a step (`Engine.step`, `POST /v1/step`)."""


class ReplicaStateError(PhyAIError, RuntimeError):
    """A control call (pause, sleep, weight update, ...) that the replica's state does not allow.

    Nothing was changed; `state` is the replica's state and `op` the refused call.
    """

    def __init__(self, message: str, *, replica: int | None = None, state: str | None = None,
                 op: str | None = None) -> None:
        super().__init__(message)
        self.replica, self.state, self.op = replica, state, op

    def __reduce__(self):
        return (_rebuild_state_error, (str(self), self.replica, self.state, self.op))


def _rebuild_aborted(message, replica) -> RequestAbortedError:
    return RequestAbortedError(message, replica=replica)


def _rebuild_state_error(message, replica, state, op) -> ReplicaStateError:
    return ReplicaStateError(message, replica=replica, state=state, op=op)


class WeightUpdateRefusedError(PhyAIError, ValueError):
    """A weight update refused before any weight changed: a name, shape or dtype does not match the model.

    The replica keeps serving its previous version with its previous weights (the update is over:
    start a new one). `problems` lists each mismatch (tensor, shapes or dtypes), `version` is the
    refused version and `serving_version` the one still served.
    """

    def __init__(self, message: str, *, replica: int | None = None, version: Any = None,
                 serving_version: Any = None, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.replica, self.version, self.serving_version = replica, version, serving_version
        self.problems = tuple(problems)

    def __reduce__(self):
        return (_rebuild_refused, (str(self), self.replica, self.version, self.serving_version, self.problems))


def _rebuild_refused(message, replica, version, serving_version, problems) -> WeightUpdateRefusedError:
    return WeightUpdateRefusedError(message, replica=replica, version=version, serving_version=serving_version,
                                    problems=problems)
