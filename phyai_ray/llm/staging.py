"""Weights received for a version not served yet: staged beside the live ones, with a digest of the bytes.

    stage = WeightStage()
    reply = stage.receive(version=7, buckets=[(bucket, flat), ...], take=model_slice, rank=0)
    reply == {"rank": 0, "version": 7, "digest": "9f2c...", "digest_s": 0.01, "bytes": 1048576}
    ...the live weights keep serving...
    staged = stage.take(7)        # at the switch: {name: this rank's tensor}, or None when 7 is not staged
    stage.discard()               # a fleet update that failed anywhere: nothing of it stays

A bucket is the trainer's format (`phyai_ray.rank.receive.Bucket`: one flat tensor of one dtype,
names, shapes, offsets); `flat` is that tensor, or a Ray ObjectRef of it. The digest is sha256
over every bucket's metadata and raw bytes, in order, exactly as this rank received them: the
sender computes the same over what it sent (`digest_of`), so a byte that differs anywhere on the
way names the rank that holds it. `take(name, full)` gives this rank's part of a full tensor (its
tensor-parallel slice, in the model's dtype, a copy) or None to skip the name (a tied head).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Iterable

import torch

from phyai_ray.rank.receive import Bucket, unflatten

Take = Callable[[str, torch.Tensor], "torch.Tensor | None"]


def resolve(flat: Any) -> torch.Tensor:
    """The flat tensor itself, fetched when it is a Ray ObjectRef."""
    if isinstance(flat, torch.Tensor):
        return flat
    import ray

    return ray.get(flat)


def digest_of(buckets: Iterable[tuple[Bucket, torch.Tensor]]) -> str:
    """sha256 of the buckets' names, shapes, dtypes and raw bytes, in order (hex)."""
    h = hashlib.sha256()
    for bucket, flat in buckets:
        h.update(repr((bucket.dtype, bucket.numel, [(m.name, m.shape, m.offset) for m in bucket.tensors])).encode())
        h.update(flat.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class WeightStage:
    """One rank's staged weights of one version (see the module docstring)."""

    def __init__(self) -> None:
        self.version: Any = None
        self.tensors: dict[str, torch.Tensor] = {}

    def receive(self, version: Any, buckets: list[tuple[Bucket, Any]], take: Take, rank: int) -> dict[str, Any]:
        """Stage `buckets` for `version` (replacing anything staged before) and report their digest."""
        self.discard()
        fetched = [(bucket, resolve(flat)) for bucket, flat in buckets]
        staged: dict[str, torch.Tensor] = {}
        for bucket, flat in fetched:
            for name, full in unflatten(bucket, flat):
                part = take(name, full)
                if part is not None:
                    staged[name] = part
        self.version, self.tensors = version, staged
        started = time.perf_counter()
        digest = digest_of(fetched)
        return {"rank": rank, "version": version, "digest": digest, "digest_s": time.perf_counter() - started,
                "bytes": sum(t.numel() * t.element_size() for t in staged.values())}

    def take(self, version: Any) -> dict[str, torch.Tensor] | None:
        """The staged tensors when `version` is staged (and forget them), else None."""
        if self.version is None or self.version != version:
            return None
        staged, self.version, self.tensors = self.tensors, None, {}
        return staged

    def discard(self) -> None:
        self.version, self.tensors = None, {}
