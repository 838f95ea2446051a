"""A sequence's failure on a rank stays that sequence's: what `RankRunner.iterate` catches, and how.

    failed = admit_each(model, plan.admit)                  # {seq_id: error} of admits that raised
    agree_admissions(model, plan.admit, failed, device)     # several ranks: one verdict for all of them
    deltas = iterate_once(model, admitted, failed, alone)   # SequenceError / out of memory: retried once
    reply = answer(deltas, failed, is_output_rank)          # a RankIteration (or None: nothing to say)

An `admit` that raises leaves the model holding nothing of that sequence (the iteration protocol's
contract), so the rank goes on with the others and reports the error per sequence. Out of device
memory in `admit` becomes `OutOfMemoryRequestError` for that request, after the CUDA cache is
emptied. In `iterate()`: a `SequenceError` names the sequences that failed, and the rank runs
`iterate()` once more for the others; out of memory there is per request only on a replica of ONE
rank (`alone`): the sequences admitted in this iteration are dropped and failed, and the others'
iteration runs once more. On several ranks an iteration that runs out of memory may have left the
other ranks inside a collective, so it raises and the replica fails (docs/concepts/replicas.md).
Anything else `iterate()` raises is the shared forward's failure: it propagates.

Ranks agree before the iteration: on a replica of several ranks, `agree_admissions` exchanges which
admits raised (one all-reduce of a [ranks, admitted] table of failure codes over the world group), so
a sequence refused on SOME rank is dropped on every rank before any collective of the iteration, and
every rank reports it failed with the same class (what the refusing rank raised is in its log). A
sequence refused by every rank alike keeps each rank's own error.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from phyai_ray.errors import OutOfMemoryRequestError, RequestRejectedError
from phyai_ray.plugins.iteration import Delta, RankIteration, SequenceError

logger = logging.getLogger(__name__)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is torch's out-of-memory error (any device)."""
    import torch

    kind = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return kind is not None and isinstance(exc, kind)


def free_cache() -> None:
    """Give cached device memory back (after a failed allocation), where there is a CUDA device."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def out_of_memory(ident: int, where: str, exc: BaseException) -> OutOfMemoryRequestError:
    """The request's error for sequence `ident` that ran out of memory `where` (torch's first line kept)."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    error = OutOfMemoryRequestError(f"sequence {ident} ran out of device memory {where} ({first}); what it took "
                                    "was freed and the replica keeps serving; retry later or send a smaller "
                                    "request", request_id=ident)
    error.__cause__ = None
    return error


def request_error(ident: int, exc: BaseException, where: str) -> BaseException:
    """What the request of sequence `ident` fails with: `exc`, or OutOfMemoryRequestError for torch's OOM."""
    if is_out_of_memory(exc):
        free_cache()
        return out_of_memory(ident, where, exc)
    return exc


def admit_each(model: Any, admit: tuple) -> dict[int, BaseException]:
    """Admit every (seq_id, payload); {seq_id: error} of those whose `admit` raised."""
    failed: dict[int, BaseException] = {}
    for ident, payload in admit:
        try:
            model.admit(ident, payload)
        except Exception as exc:  # that sequence's own failure: the model holds nothing of it
            logger.warning("sequence %d: admit raised %s", ident, type(exc).__name__, exc_info=exc)
            failed[ident] = request_error(ident, exc, "while it was admitted")
    return failed


_KINDS = {1: "refused", 2: "out of memory", 3: "failed"}  # a rank's failure code, as the all-reduce carries it


def agree_admissions(model: Any, admit: tuple, failed: dict[int, BaseException], device: Any) -> None:
    """One verdict per admitted sequence on every rank of the replica (see the module docstring):
    `failed` gains the sequences that failed on another rank (dropped here), with errors alike on every rank."""
    from phyai_ray.collectives import P

    world = P.size("world") if admit else 1
    if world == 1:
        return
    import torch

    idents = [ident for ident, _ in admit]
    table = torch.zeros(world, len(idents), dtype=torch.int32, device=device)
    me = P.rank("world")
    for j, ident in enumerate(idents):
        if ident in failed:
            table[me, j] = _code(failed[ident])
    codes = P.all_reduce(table, group="world").cpu().tolist()  # every rank wrote its own row only
    for j, ident in enumerate(idents):
        ranks = [r for r in range(world) if codes[r][j]]
        if not ranks or (len(ranks) == world and len({codes[r][j] for r in ranks}) == 1):
            continue  # admitted everywhere, or refused everywhere alike (each rank keeps its own error)
        if ident not in failed:
            model.drop(ident)
        kind = codes[ranks[0]][j]
        failed[ident] = _AGREED[kind](
            f"sequence {ident} was {_KINDS[kind]} on rank(s) {ranks} of {world} while it was admitted; every rank "
            f"of the replica dropped it and ran the others (rank {ranks[0]}'s log has its error)")


def _code(error: BaseException) -> int:
    return 2 if isinstance(error, OutOfMemoryRequestError) else 1 if isinstance(error, RequestRejectedError) else 3


_AGREED: dict[int, type[BaseException]] = {1: RequestRejectedError, 2: OutOfMemoryRequestError, 3: RuntimeError}


def iterate_once(model: Any, admitted: list[int], failed: dict[int, BaseException], alone: bool) -> Any:
    """`model.iterate()`, retried once after a `SequenceError` (and, when `alone`, after out of memory,
    failing the sequences admitted in it); the failed sequences go into `failed`."""
    try:
        return model.iterate()
    except SequenceError as exc:
        for ident, error in exc.errors.items():
            failed[ident] = request_error(ident, error, "in its iteration")
    except Exception as exc:
        fresh = [ident for ident in admitted if ident not in failed]
        if not (alone and fresh and is_out_of_memory(exc)):
            raise
        for ident in fresh:
            model.drop(ident)
            failed[ident] = out_of_memory(ident, "in the iteration that admitted it", exc)
        free_cache()
    return model.iterate()


def answer(deltas: dict[int, Delta] | None, failed: dict[int, BaseException], output: bool) -> RankIteration | None:
    """The rank's reply: the output rank's deltas and errors; a non-output rank's failed kinds, or None."""
    kinds = {ident: type(error).__name__ for ident, error in failed.items()}
    if output:
        return RankIteration(deltas, {ident: portable(error) for ident, error in failed.items()}, kinds)
    return RankIteration(None, {}, kinds) if kinds else None


def portable(error: BaseException) -> BaseException:
    """`error` when it pickles (it may cross to the engine's process), else a RuntimeError naming its type
    and message."""
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
