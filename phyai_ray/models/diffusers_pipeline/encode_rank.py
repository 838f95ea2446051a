"""`EncodeRank`: the one rank of a replica that runs the encode stage, and how its outputs reach the others.

    where = EncodeRank(family_cls.encoded, ctx)     # before loading: `where.here` says whether this rank
                                                     # loads the text / image encoders (loading.py)
    failed = stage_failures if where.here else {}    # the encode ran on the encode stage of THIS rank only
    failed = where.share(jobs, failed)               # on the loop's thread, every rank: the same `failed`,
                                                     # and every job's encoded tensors on every rank

On a replica of several ranks, a family that names its encoded tensors (`Family.encoded`: Wan's
("cond", "uncond"), Wan I2V's image rows and condition, Cosmos' conditioning latents and masks)
encodes on the output rank alone, every guidance branch of every request (`Family.encoding`), and
`share` sends the results over the replica's "world" group: first one int64 header of fixed size
(per job: its status, then per encoded key: absent / None / a tensor, its dtype, ndim and shape up
to MAX_DIMS dims), then every tensor's bytes as ONE uint8 buffer (none when nothing encoded). E.g.
Wan with 2 guided jobs: header [2, 1 + 2 x (3 + 6)]; payload 2 x (cond + uncond) rows of [1, 512, 4096]
(16 MiB in bfloat16). Every rank receives every branch, the one a cfg rank does not use too: one
broadcast over the replica instead of one per branch's ranks. Every rank calls `share` for the same jobs at the same point of its iteration, on the loop's
thread, so the world group sees these broadcasts in one order beside the step's collectives. A job
whose encode failed on the encoding rank has status 1 and no tensors: every rank drops it (the
output rank with its own error, the others with a RuntimeError naming the encoding rank). The
broadcasts wait as long as the replica's process groups allow (collective_timeout_s).

One rank, or a family with nothing named (Cosmos3 reads token ids: no text encoder), encodes on
every rank as before, and `share` returns `failed` unchanged.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

MAX_DIMS = 6  # the most dims an encoded tensor has (Wan's condition: [1, 20, F, h, w])
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool)
ABSENT, NONE, TENSOR = 0, 1, 2  # what an encoded key holds in a job's cond


class EncodeRank:
    """Where the encode stage runs in a replica, and `share` of its outputs (see the module docstring)."""

    def __init__(self, keys: tuple[str, ...], ctx: Any) -> None:
        self.keys = tuple(keys)
        self.shared = bool(self.keys) and ctx.group_size("world") > 1
        # the output rank encodes: its world rank (= its rank in the "world" group, whose members are 0..n-1)
        self.source = ctx.groups.topology.output_rank if self.shared else ctx.rank
        self.here = not self.shared or ctx.is_output_rank
        self.device = torch.device(ctx.device)

    @property
    def where(self) -> str:
        """For the rank's log line: "on every rank", "here" or "on rank 0"."""
        if not self.shared:
            return "on every rank"
        return "here" if self.here else f"on rank {self.source}"

    def share(self, jobs: list[Any], failed: dict[int, BaseException]) -> dict[int, BaseException]:
        """Every rank: {id(job): error} of the jobs whose encode failed on the encoding rank, and each other
        job's encoded tensors in its cond (collective over "world"; see the module docstring)."""
        if not self.shared or not jobs:
            return failed
        header = _broadcast(self._header(jobs, failed) if self.here else self._blank(len(jobs)), self.source)
        rows = header.tolist()
        size = sum(_size(dtype, shape) for row in rows if not row[0]
                   for _, kind, dtype, shape in _fields(row, self.keys) if kind == TENSOR)
        if size:
            payload = self._payload(jobs, failed) if self.here else \
                torch.empty(size, dtype=torch.uint8, device=self.device)
            payload = _broadcast(payload, self.source)
            if not self.here:
                self._fill(jobs, rows, payload)
        if self.here:
            return failed
        error = (f"the encode of this request failed on rank {self.source}, the replica's encoding rank, which "
                 "reports its error")
        return {id(job): RuntimeError(error) for job, row in zip(jobs, rows) if row[0]}

    def _blank(self, count: int) -> torch.Tensor:
        return torch.zeros(count, 1 + len(self.keys) * (3 + MAX_DIMS), dtype=torch.int64, device=self.device)

    def _header(self, jobs: list[Any], failed: dict[int, BaseException]) -> torch.Tensor:
        """Per job: [status, then per key: kind, dtype index, ndim, shape padded to MAX_DIMS]."""
        header = self._blank(len(jobs)).cpu()
        for k, job in enumerate(jobs):
            if id(job) in failed:
                header[k, 0] = 1
                continue
            for i, key in enumerate(self.keys):
                header[k, 1 + i * (3 + MAX_DIMS):1 + (i + 1) * (3 + MAX_DIMS)] = torch.tensor(_describe(job.cond, key))
        return header.to(self.device)

    def _payload(self, jobs: list[Any], failed: dict[int, BaseException]) -> torch.Tensor:
        parts = [job.cond[key].detach().contiguous().view(-1).view(torch.uint8).to(self.device)
                 for job in jobs if id(job) not in failed
                 for key in self.keys if isinstance(job.cond.get(key), torch.Tensor)]
        return torch.cat(parts)

    def _fill(self, jobs: list[Any], header: list[list[int]], payload: torch.Tensor) -> None:
        """Each encoded job's cond from the payload, in the order `_payload` wrote it (own storage each)."""
        at = 0
        for job, row in zip(jobs, header):
            for key, kind, dtype, shape in ([] if row[0] else _fields(row, self.keys)):
                if kind == NONE:
                    job.cond[key] = None
                elif kind == TENSOR:
                    size = _size(dtype, shape)
                    job.cond[key] = payload[at:at + size].clone().view(dtype).view(shape)
                    at += size


def _broadcast(x: torch.Tensor, source: int) -> torch.Tensor:
    """World rank `source`'s `x` into every rank's `x` over the active "world" group, addressed by its group
    rank (`group_src`: no global-rank lookup, so it serves any process group object)."""
    import torch.distributed as dist

    from phyai_ray.process_groups import active

    dist.broadcast(x, group=active().handle("world"), group_src=source)
    return x


def _describe(cond: dict[str, Any], key: str) -> list[int]:
    """[kind, dtype index, ndim, dims padded to MAX_DIMS] of cond[key]."""
    value = cond.get(key, ...)
    if value is ...:
        return [ABSENT] + [0] * (2 + MAX_DIMS)
    if value is None:
        return [NONE] + [0] * (2 + MAX_DIMS)
    if not isinstance(value, torch.Tensor) or value.dtype not in DTYPES or value.ndim > MAX_DIMS:
        raise TypeError(f"encoded cond[{key!r}] must be None or a tensor of at most {MAX_DIMS} dims in one of "
                        f"{[str(d) for d in DTYPES]}, got {type(value).__name__} {getattr(value, 'dtype', '')} "
                        f"{list(getattr(value, 'shape', []))}")
    return [TENSOR, DTYPES.index(value.dtype), value.ndim, *value.shape, *[0] * (MAX_DIMS - value.ndim)]


def _fields(row: list[int], keys: tuple[str, ...]) -> Iterator[tuple[str, int, torch.dtype, list[int]]]:
    """(key, kind, dtype, shape) of each encoded key in one job's header row."""
    width = 3 + MAX_DIMS
    for i, key in enumerate(keys):
        kind, dtype, ndim, *dims = row[1 + i * width:1 + (i + 1) * width]
        yield key, kind, DTYPES[dtype], dims[:ndim]


def _size(dtype: torch.dtype, shape: list[int]) -> int:
    """Bytes of a tensor of `dtype` and `shape`."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
