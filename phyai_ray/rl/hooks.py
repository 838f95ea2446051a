"""Control operations of one rank, and their defaults for models that do not define them.

A per-rank model may define any of these hooks; each is called on EVERY rank of the replica,
on the rank's control lane, while no request runs there:

    pause() / resume()          nothing by default
    sleep(level)                level 1: weights kept on the host (moved off the GPU), level 2:
                                weights dropped (a weight update must refill them before serving)
    wake_up(tags)               "weights": back on the rank's device; "kv_cache": reset_cache()
    reset_cache()               nothing by default (after every weight update, and on request)
    load_weights(weights)       weights: a list of (name, full tensor) from the trainer; by default
                                copied into the parameters and buffers of the same name

The defaults act on a plain `torch.nn.Module`: the model itself, or its `module` attribute.
"""

from __future__ import annotations

import logging
from typing import Any

from phyai_ray.rl.transfer import Bucket, TransferSpec, empty_flat, join_group, open_cuda, unflatten

logger = logging.getLogger(__name__)


def torch_module(model: Any) -> Any:
    import torch

    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None


class RankControl:
    """The control lane's side of one rank: hooks, sleep state and the weight transfer group."""

    def __init__(self, model: Any, ctx: Any) -> None:
        self.model, self.ctx = model, ctx
        self.asleep_level = 0
        self.version: Any = None
        self._group: Any = None
        self._spec: TransferSpec | None = None

    def run(self, op: str, args: tuple) -> Any:
        return getattr(self, op)(*args)

    # -- states ------------------------------------------------------------------------------
    def pause(self, *args: Any) -> Any:
        return self._hook("pause")

    def resume(self) -> Any:
        return self._hook("resume")

    def sleep(self, level: int) -> dict[str, Any]:
        if hasattr(self.model, "sleep"):
            self.model.sleep(level)
        elif self.asleep_level < level:
            self._default_sleep(level)
        self.asleep_level = max(self.asleep_level, level)
        return {"rank": self.ctx.rank, "level": self.asleep_level}

    def wake_up(self, tags: Any) -> dict[str, Any]:
        tags = set(tags or ("weights", "kv_cache"))
        if hasattr(self.model, "wake_up"):
            self.model.wake_up(sorted(tags))
        else:
            if "weights" in tags and self.asleep_level:
                self._default_wake()
            if "kv_cache" in tags:
                self._hook("reset_cache")
        if "weights" in tags:
            self.asleep_level = 0
        return {"rank": self.ctx.rank, "awake": sorted(tags)}

    def reset_cache(self) -> Any:
        return self._hook("reset_cache")

    # -- weights ---------------------------------------------------------------------------------
    def init_weight_transfer(self, spec: TransferSpec | None, group_rank: int = 0, group_size: int = 0) -> int:
        """Join this replica's transfer group (gloo / nccl): blocks until the trainer joins too."""
        self._close_group()
        self._spec = spec
        if spec is not None and spec.backend in ("gloo", "nccl"):
            self._group = join_group(spec, group_rank, group_size)
        return self.ctx.rank

    def start_weight_update(self, version: Any) -> int:
        return self.ctx.rank

    def update_weights(self, buckets: tuple[Bucket, ...]) -> int:
        """Receive every bucket, then load them all at once (a model sees the whole update)."""
        weights = []
        for bucket in buckets:
            weights += unflatten(bucket, self._receive(bucket))
        self._load(weights)
        if any(b.ipc for b in buckets):
            import torch

            del weights
            torch.cuda.ipc_collect()  # drop this process's mappings of the trainer's memory
        return len(buckets)

    def finish_weight_update(self, version: Any) -> int:
        self.version = version
        if hasattr(self.model, "weight_version"):  # a plugin that stamps its outputs (e.g. TokenOutput)
            self.model.weight_version = version
        self._hook("reset_cache")
        return self.ctx.rank

    def _receive(self, bucket: Bucket) -> Any:
        if bucket.ipc is not None:
            return open_cuda(bucket, self.ctx.device)
        if bucket.ref is not None:
            import ray

            return ray.get(bucket.ref, timeout=self._spec.timeout_s if self._spec else 600.0)
        if self._group is None:
            raise RuntimeError(f"rank {self.ctx.rank}: update_weights without a transfer group; call "
                               "init_weight_transfer(backend) first")
        flat = empty_flat(bucket, self.ctx.device)
        self._group.broadcast(flat, 0).wait()
        return flat

    def _load(self, weights: list[tuple[str, Any]]) -> None:
        if hasattr(self.model, "load_weights"):
            self.model.load_weights(weights)
            return
        module = torch_module(self.model)
        if module is None:
            raise TypeError(f"per-rank model {type(self.model).__name__} has no load_weights(weights) and is not a "
                            "torch.nn.Module; define load_weights to receive (name, tensor) pairs")
        own = dict(module.named_parameters()) | dict(module.named_buffers())
        unknown = [n for n, _ in weights if n not in own]
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} name(s) not in the model, e.g. {unknown[:3]}")
        import torch

        with torch.no_grad():
            for name, tensor in weights:
                target = own[name]
                if target.numel() == 0:  # dropped by sleep(level=2): take the new tensor whole
                    target.data = tensor.to(device=self.ctx.device, dtype=target.dtype).clone()
                else:
                    target.copy_(tensor)

    # -- defaults for a torch.nn.Module ---------------------------------------------------------------
    def _default_sleep(self, level: int) -> None:
        module = torch_module(self.model)
        if module is None:
            return
        import torch

        for tensor in list(module.parameters()) + list(module.buffers()):
            tensor.data = tensor.data.to("cpu") if level == 1 else torch.empty(0, dtype=tensor.dtype)

    def _default_wake(self) -> None:
        module = torch_module(self.model)
        if module is not None and self.asleep_level == 1:
            for tensor in list(module.parameters()) + list(module.buffers()):
                tensor.data = tensor.data.to(self.ctx.device)

    def _hook(self, name: str) -> Any:
        fn = getattr(self.model, name, None)
        return fn() if callable(fn) else None

    def _close_group(self) -> None:
        self._group = None

    def close(self) -> None:
        self._close_group()
