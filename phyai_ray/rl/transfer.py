"""Weights leaving the trainer: flattened, size-capped buckets, and how each backend shares them.

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

The bucket format and the receiving half (what a rank runs) are in `phyai_ray.rank.receive`; this
module is the sending half a trainer runs (`phyai_ray.rl.sender.WeightSender`).
"""

from __future__ import annotations

from typing import Any, Iterable

from phyai_ray.rank.receive import Bucket, TensorMeta, gpu_uuid

DEFAULT_BUCKET_BYTES = 64 << 20


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


def share_cuda(flat: Any) -> dict[str, Any]:
    """{GPU UUID: IPC handle} of a CUDA tensor; the sender keeps `flat` alive until the update finishes."""
    from torch.multiprocessing.reductions import reduce_tensor

    return {gpu_uuid(flat.device): reduce_tensor(flat)}
