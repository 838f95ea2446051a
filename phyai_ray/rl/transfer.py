"""Weights in flight: flattened, size-capped buckets, and the groups that carry them.

A trainer's `named_parameters()` become buckets of one dtype each, at most `bucket_bytes` large
(a tensor larger than that gets a bucket of its own). A bucket is one flat tensor plus the name,
shape and offset of each tensor in it, so a transfer moves a few large buffers instead of
hundreds of small ones. Backends:

    object_store  each bucket is `ray.put` once; every rank `ray.get`s it (shared memory on a node)
    gloo / nccl   the trainer broadcasts each bucket over a transfer group of its own with the ranks
                  of ONE replica (group rank 0 = trainer), so a replica that dies mid-sync breaks
                  only its own group
    cuda_ipc      same node, same GPU (HYBRID / COLOCATED): the trainer shares each flat CUDA
                  bucket by a CUDA IPC handle keyed by the GPU's physical id (its UUID); a rank maps
                  the handle of its own GPU and copies from it, then `torch.cuda.ipc_collect()`
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

BACKENDS = ("object_store", "gloo", "nccl", "cuda_ipc")
DEFAULT_BUCKET_BYTES = 64 << 20


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
    """One rank's verdict on an update before any weight changes: each mismatch as one line."""

    rank: int
    problems: tuple[str, ...] = ()


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


def plan_buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> list[tuple[Bucket, list[Any]]]:
    """Group tensors into buckets of one dtype, in order; returns (bucket, its tensors) pairs."""
    out: list[tuple[Bucket, list[Any]]] = []
    open_: dict[str, tuple[list[TensorMeta], list[Any], int]] = {}
    for name, tensor in named:
        t = tensor.detach()
        key = str(t.dtype).removeprefix("torch.")
        metas, tensors, used = open_.get(key, ([], [], 0))
        if tensors and (used + t.numel()) * t.element_size() > bucket_bytes:
            out.append((Bucket(key, used, tuple(metas)), tensors))
            metas, tensors, used = [], [], 0
        metas.append(TensorMeta(name, tuple(t.shape), used, t.numel()))
        tensors.append(t)
        open_[key] = (metas, tensors, used + t.numel())
    out += [(Bucket(k, used, tuple(m)), ts) for k, (m, ts, used) in open_.items() if ts]
    return out


def flatten(tensors: list[Any], device: Any = "cpu") -> Any:
    import torch

    return torch.cat([t.reshape(-1).to(device) for t in tensors])


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


def share_cuda(flat: Any) -> dict[str, Any]:
    """{GPU UUID: IPC handle} of a CUDA tensor; the sender keeps `flat` alive until the update finishes."""
    from torch.multiprocessing.reductions import reduce_tensor

    return {gpu_uuid(flat.device): reduce_tensor(flat)}


def open_cuda(bucket: Bucket, device: Any) -> Any:
    """Map the bucket's IPC handle for this rank's GPU (a view of the sender's memory: copy from it)."""
    handle = (bucket.ipc or {}).get(gpu_uuid(device))
    if handle is None:
        raise RuntimeError(f"cuda_ipc: the trainer shared the weights on GPU(s) {sorted(bucket.ipc or {})}, not on "
                           f"this rank's GPU {gpu_uuid(device)}; cuda_ipc needs trainer and rank on one GPU "
                           "(HYBRID / COLOCATED), use nccl otherwise")
    rebuild, args = handle
    return rebuild(*args)
