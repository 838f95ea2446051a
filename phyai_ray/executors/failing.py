"""Which requests an iteration's failure fails, and with what (the iteration loop's failure path).

    failed_alone(running, live, forget, errors)    the requests of sequences that failed alone
    failed_all(index, running, forget, error)       every running request (the shared forward failed)
    reply_parts(reply)                              the deltas, and {seq_id: error} of those that failed alone

A request's failure is its own: a sequence whose `admit` raised on every rank, one a `SequenceError`
named, or one whose Delta ended it with `stop_reason="error"` fails its request alone, with its own
error; the loop goes on with the others, and the ranks drop the sequence at the next plan. An
iteration that raises without naming sequences fails every request that ran in it; when there are
several, each gets an error naming the sequences and the cause's type, never the cause's message
(it may quote one request's prompt; the engine's log has it). Mapping: docs/concepts/replicas.md.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.plugins.iteration import Delta, RankIteration

logger = logging.getLogger(__name__)


def failed_alone(running: dict, live: Any, forget: Callable[[Any], None],
                 errors: dict[int, BaseException]) -> list[tuple[Any, None, BaseException]]:
    """(request, None, error) of each running sequence in `errors` whose request is still `live`; each is forgotten."""
    failed = []
    for ident, error in errors.items():
        seq = running.get(ident)
        if seq is not None and seq.request in live:
            forget(seq.request)
            failed.append((seq.request, None, error))
    return failed


def failed_all(index: int, running: dict, forget: Callable[[Any], None],
               error: BaseException) -> list[tuple[Any, None, BaseException]]:
    """(request, None, error) of every running sequence's request, each forgotten (see the module docstring)."""
    requests = {id(s.request): s.request for s in running.values()}
    if len(requests) > 1 and not isinstance(error, EngineUnavailableError):
        logger.error("replica %d: an iteration failed in the shared forward", index, exc_info=error)
        error = RuntimeError(
            f"replica {index}: an iteration raised {type(error).__name__} in the shared forward while sequences "
            f"{sorted(running)[:32]} ran; every request in it failed (the replica keeps serving; the engine's "
            "log has the exception)")
    for req in requests.values():
        forget(req)
    return [(req, None, error) for req in requests.values()]


def delta_errors(deltas: dict[int, Delta]) -> dict[int, BaseException]:
    """{seq_id: error} of each delta that ends its sequence failed (`Delta.error`, or stop_reason "error")."""
    return {ident: delta.error or RuntimeError(f"sequence {ident}: the model ended it with stop_reason='error' "
                                               "and no Delta.error")
            for ident, delta in deltas.items() if delta.error is not None or delta.stop_reason == "error"}


def reply_parts(reply: RankIteration | dict[int, Delta] | None) -> tuple[dict[int, Delta], dict[int, BaseException]]:
    """The output rank's deltas, and {seq_id: error} of the sequences that failed alone: on every rank
    (`RankIteration.errors`) or by their delta."""
    if isinstance(reply, RankIteration):
        deltas, errors = reply.deltas or {}, dict(reply.errors)
    else:
        deltas, errors = reply or {}, {}
    errors.update(delta_errors(deltas))
    return deltas, errors

