"""What a rank receives in a weight update: the bucket format both sides agree on, and the receiving half.

A trainer's weights travel as buckets (`phyai_ray.rl.transfer` plans and sends them): one flat
tensor of one dtype plus the name, shape and offset of each tensor in it. A rank rebuilds the
tensors as views of that flat buffer (`unflatten`). How the flat buffer reaches the rank depends
on the backend the engine was given (`TransferSpec.backend`):

    object_store  `Bucket.ref` is an ObjectRef: the rank `ray.get`s it
    gloo / nccl   the rank joins its replica's transfer group (`join_group`; group rank 0 is the
                  trainer) and receives each bucket by broadcast into `empty_flat(bucket, device)`
    cuda_ipc      `Bucket.ipc` maps a GPU's physical id to a CUDA IPC handle; the rank opens the
                  handle of its own GPU (`open_cuda`) and copies from it

Before anything is received every rank answers a `WeightCheck`: the problems it found, one line
each (`phyai_ray.rank.loading`). Ray is not imported here; torch only inside the functions.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterator

BACKENDS = ("object_store", "gloo", "nccl", "cuda_ipc")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the bucket's dtype
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: str
    numel: int
    tensors: tuple[TensorMeta, ...]
    ref: Any = None  # object_store: the ObjectRef of the flat tensor
    ipc: Any = None  # cuda_ipc: {physical GPU UUID: (rebuild function, its arguments)}


@dataclass(frozen=True)
class WeightCheck:
    """One rank's verdict on an update before any weight changes: each mismatch as one line, and
    each tensor the model accepts differently than sent (skipped, cast), as `notes`."""

    rank: int
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TransferSpec:
    """How the ranks of one replica reach the trainer (gloo / nccl); None fields for object_store."""

    backend: str
    master_addr: str | None = None
    master_port: int | None = None
    group: str | None = None  # store prefix of this replica's group
    timeout_s: float = 600.0


def check_backend(backend: str, device_type: str = "cpu") -> None:
    if backend not in BACKENDS:
        raise ValueError(f"weight transfer backend {backend!r} is unknown; use one of {BACKENDS}")
    if backend in ("nccl", "cuda_ipc") and device_type != "cuda":
        raise ValueError(f"the {backend} weight transfer needs CUDA ranks; use 'gloo' or 'object_store' on CPU")


def unflatten(bucket: Bucket, flat: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor view) of every tensor in `bucket`, read from its flat buffer."""
    for meta in bucket.tensors:
        yield meta.name, flat[meta.offset: meta.offset + meta.numel].view(meta.shape)


def empty_flat(bucket: Bucket, device: Any) -> Any:
    import torch

    return torch.empty(bucket.numel, dtype=getattr(torch, bucket.dtype), device=device)


def join_group(spec: TransferSpec, rank: int, world_size: int) -> Any:
    """This process's member of one replica's transfer group (the trainer is rank 0 and hosts the store)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.master_addr, spec.master_port, world_size, False, timeout=timeout)
    prefixed = dist.PrefixStore(spec.group, store)
    if spec.backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def gpu_uuid(device: Any) -> str:
    """The physical id of a CUDA device (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def open_cuda(bucket: Bucket, device: Any) -> Any:
    """Map the bucket's IPC handle for this rank's GPU (a view of the sender's memory: copy from it)."""
    handle = (bucket.ipc or {}).get(gpu_uuid(device))
    if handle is None:
        raise RuntimeError(f"cuda_ipc: the trainer shared the weights on GPU(s) {sorted(bucket.ipc or {})}, not on "
                           f"this rank's GPU {gpu_uuid(device)}; cuda_ipc needs trainer and rank on one GPU "
                           "(HYBRID / COLOCATED), use nccl otherwise")
    rebuild, args = handle
    return rebuild(*args)
