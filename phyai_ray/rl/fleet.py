"""One weight version across a fleet of rollout engines, verified before it is served.

    sender = WeightSender()
    report = sender.update([engine_a, engine_b, actor_c], model.named_parameters(), version=8)
    report.pause_s, report.verify_s, report.stage_s

1. stage     every rank of every replica of every target receives the buckets (the trainer's flat
             tensors, as `collective_rpc` arguments: a Ray group's same-node lane shares them in
             shared memory, one copy for all its ranks) and keeps its slices BESIDE its live weights (`stage_weights` on the per-rank model, through
             `collective_rpc`): the fleet keeps serving version v - 1 meanwhile.
2. verify    each rank answers the sha256 of the bytes it received (`phyai_ray.llm.staging`); the
             sender computes the same over what it sent. Any rank that differs, or any stage that
             failed, and every rank forgets what it staged (`discard_staged`): the fleet stays at
             v - 1 and `FleetUpdateError` names the target, replica and rank.
3. switch    every replica of every target enters UPDATING (each stops at its iteration boundary),
             then `update_weights((STAGED,))` (nothing to receive) and `finish_weight_update()`
             on all of them: each rank's model switches to its staged weights as version v is
             published. No replica serves between the first stop and the last publish, so no
             result delivered after the switch carries v - 1. A replica that dies during the
             switch is FAILED, as in any update (it serves nothing, neither version).

The per-rank model must offer `stage_weights(version, buckets)` and `discard_staged()` and switch
in its `weight_version` setter (`hf_causal_lm` does).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable

from phyai_ray.errors import PhyAIError
from phyai_ray.executors.updates import STAGED
from phyai_ray.llm.staging import digest_of
from phyai_ray.rl.transfer import DEFAULT_BUCKET_BYTES, flatten, plan_buckets


class FleetUpdateError(PhyAIError, RuntimeError):
    """A fleet update that was rolled back: every target still serves its previous version.
    `differed` lists (target index, replica, rank, why) of each rank that failed or differed."""

    def __init__(self, message: str, *, version: Any = None, differed: tuple = ()) -> None:
        super().__init__(message)
        self.version, self.differed = version, differed

    def __reduce__(self):
        return (_rebuild, (str(self), self.version, self.differed))


def _rebuild(message: str, version: Any, differed: tuple) -> FleetUpdateError:
    return FleetUpdateError(message, version=version, differed=differed)


@dataclass
class FleetReport:
    """What a fleet update did, with its costs in seconds."""

    version: Any
    bytes_sent: int
    stage_s: float  # transfer into every rank's staging, while serving
    verify_s: float  # the sender's digest plus the slowest rank's
    pause_s: float  # from the first replica stopping to the last publishing v
    paused_at: float = 0.0  # time.monotonic() when the switch began (results before it: v - 1)
    switched_at: float = 0.0  # time.monotonic() when every replica had published v
    reports: list = field(default_factory=list)  # every target's finish_weight_update reports


def update_fleet(targets: list, named_parameters: Iterable[tuple[str, Any]], version: Any, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0) -> FleetReport:
    """Stage, verify and switch `targets` (`_Target`s of WeightSender) to `version` (module docstring)."""
    planned = [(bucket, flatten(tensors)) for bucket, tensors in plan_buckets(named_parameters, bucket_bytes)]
    started = time.perf_counter()
    expected = digest_of(planned)
    sender_digest_s = time.perf_counter() - started
    payload = planned  # the tensors themselves: the same-node lane puts them in shared memory once for every rank
    started = time.perf_counter()
    replies = _on_all(targets, "collective_rpc", "stage_weights", version, payload, all_ranks=True,
                      timeout=timeout_s)
    stage_s = time.perf_counter() - started
    differed, slowest = _differed(replies, expected)
    if differed:
        _on_all(targets, "collective_rpc", "discard_staged", all_ranks=True, timeout=timeout_s)
        named = "; ".join(f"target {t} replica {r} rank {k}: {why}" for t, r, k, why in differed)
        raise FleetUpdateError(f"the fleet update to version {version!r} was rolled back on every target (each "
                               f"still serves its previous version): {named}", version=version,
                               differed=tuple(differed))
    paused = time.monotonic()
    for phase, args in (("start_weight_update", (version,)), ("update_weights", ((STAGED,),)),
                        ("finish_weight_update", ())):
        done = _on_all(targets, phase, *args, timeout=timeout_s)
    switched = time.monotonic()
    return FleetReport(version, sum(f.numel() * f.element_size() for _, f in planned), stage_s,
                       sender_digest_s + slowest, switched - paused, paused, switched,
                       [r for reports in done for r in _value(reports)])


def _on_all(targets: list, name: str, *args: Any, **kwargs: Any) -> list:
    """`name(*args, **kwargs)` on every target at once: each one's result, or the exception it raised."""
    futures = [t.start(name, *args, **kwargs) for t in targets]
    out = []
    for f in futures:
        try:
            out.append(f.result(timeout=kwargs.get("timeout", 120.0) + 30))
        except Exception as exc:  # noqa: BLE001 - reported per target by the caller
            out.append(exc)
    for result in out:
        if isinstance(result, Exception) and name != "collective_rpc":
            raise result
    return out


def _value(result: Any) -> list:
    return result if isinstance(result, list) else [result]


def _differed(replies: list, expected: str) -> tuple[list, float]:
    """(target, replica, rank, why) of every rank that failed or whose digest differs; the slowest digest_s."""
    differed, slowest = [], 0.0
    for t, per_replica in enumerate(replies):
        if isinstance(per_replica, Exception):
            differed.append((t, None, None, f"{type(per_replica).__name__}: {per_replica}"))
            continue
        for r, ranks in enumerate(per_replica):
            for reply in ranks:
                slowest = max(slowest, reply.get("digest_s", 0.0))
                if reply["digest"] != expected:
                    differed.append((t, r, reply["rank"], f"digest {reply['digest'][:12]} != sent {expected[:12]}"))
    return differed, slowest
