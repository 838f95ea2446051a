"""Control operations of one rank, and their defaults for models that do not define them.

A per-rank model may define any of these hooks; each is called on EVERY rank of the replica,
on the rank's control lane, while no request runs there:

    pause() / resume()          nothing by default
    sleep(level) -> int         level 1: caches freed, weights kept on the host (moved off the GPU;
                                on a CPU: caches only), level 2: weights dropped too (a weight update
                                must refill them before serving); returns the bytes it freed on this
                                rank (host + device). Without it: the module default below, which
                                counts the bytes it moves off the device or drops; a model with
                                neither raises SleepUnsupportedError (nothing is freed, no level)
    wake_up(tags)               "weights": back on the rank's device; "kv_cache": reset_cache()
    reset_cache()               nothing by default (after every weight update, and on request)
    load_weights(weights)       weights: a list of (name, full tensor) from the trainer; by default
                                copied into the parameters and buffers of the same name
    weight_specs()              {name: (full shape, dtype)} an update is checked against before any
                                weight changes (default: the module's parameters and buffers); a
                                model that defines it gets load_weights once per bucket

The defaults act on a plain `torch.nn.Module`: the model itself, or its `module` attribute. A
weight update reaches a rank as three ops: `check_weights` (every rank, nothing received), then
`update_weights` (bucket by bucket) or, for a refused update, `drain_weights`
(`phyai_ray.rank.loading`).
"""

from __future__ import annotations

import logging
from typing import Any

from phyai_ray.errors import SleepUnsupportedError
from phyai_ray.rank.loading import WeightLoader, torch_module
from phyai_ray.rank.receive import Bucket, TransferSpec, WeightCheck, empty_flat, join_group, open_cuda

logger = logging.getLogger(__name__)


class RankControl:
    """The control lane's side of one rank: hooks, sleep state and the weight transfer group."""

    def __init__(self, model: Any, ctx: Any, plugin: str = "") -> None:
        self.model, self.ctx, self.plugin = model, ctx, plugin or type(model).__name__
        self.asleep_level = 0
        self.version: Any = None
        self._group: Any = None
        self._spec: TransferSpec | None = None
        self.loader = WeightLoader(model, ctx)

    def run(self, op: str, args: tuple) -> Any:
        return getattr(self, op)(*args)

    # -- states ------------------------------------------------------------------------------
    def pause(self, *args: Any) -> Any:
        return self._hook("pause")

    def resume(self) -> Any:
        return self._hook("resume")

    def sleep(self, level: int) -> dict[str, Any]:
        """{"rank", "level" reached, "freed_bytes" on this rank}; SleepUnsupportedError when nothing can sleep."""
        freed = 0
        if callable(getattr(self.model, "sleep", None)):
            freed = int(self.model.sleep(level) or 0)
            if level == 2:
                self.loader.dropped_by_model()
        elif torch_module(self.model) is None:
            raise SleepUnsupportedError(
                f"plugin {self.plugin}: its per-rank model {type(self.model).__name__} defines no sleep(level) -> int "
                "and holds no torch.nn.Module to fall back on, so sleep() would free nothing; nothing was changed "
                "(define sleep(level) returning the bytes it frees, and wake_up(tags))", plugin=self.plugin)
        elif self.asleep_level < level:
            freed = self._default_sleep(level)
        self.asleep_level = max(self.asleep_level, level)
        return {"rank": self.ctx.rank, "level": self.asleep_level, "freed_bytes": freed}

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

    def check_weights(self, buckets: tuple[Bucket, ...]) -> WeightCheck:
        """Names, shapes and dtypes of the update against the model; nothing is received or changed."""
        return self.loader.check(buckets)

    def update_weights(self, buckets: tuple[Bucket, ...]) -> int:
        """Receive and load the (checked) buckets one by one; a model without weight_specs sees them whole."""
        self.loader.load(buckets, self._receive)
        if any(b.ipc for b in buckets):
            import torch

            torch.cuda.ipc_collect()  # drop this process's mappings of the trainer's memory
        return len(buckets)

    def drain_weights(self, buckets: tuple[Bucket, ...]) -> int:
        """A refused update: take the trainer's broadcast and drop it, so its send completes."""
        self.loader.drain(buckets, self._receive)
        return len(buckets)

    def unloaded_weights(self) -> WeightCheck:
        """The weights sleep(level=2) dropped that no update has refilled yet."""
        return self.loader.unloaded_report()

    def finish_weight_update(self, version: Any) -> int:
        self.version = version
        if hasattr(self.model, "weight_version"):  # a plugin that stamps its outputs (e.g. TokenOutput)
            self.model.weight_version = version
        self._hook("reset_cache")
        return self.ctx.rank

    def _receive(self, bucket: Bucket, into: Any = None) -> Any:
        """The bucket's flat tensor; a broadcast lands in `into` when given (a reused buffer)."""
        if bucket.ipc is not None:
            return open_cuda(bucket, self.ctx.device)
        if bucket.ref is not None:
            import ray

            return ray.get(bucket.ref, timeout=self._spec.timeout_s if self._spec else 600.0)
        if self._group is None:
            raise RuntimeError(f"rank {self.ctx.rank}: update_weights without a transfer group; call "
                               "init_weight_transfer(backend) first")
        flat = into if into is not None else empty_flat(bucket, self.ctx.device)
        self._group.broadcast(flat, 0).wait()
        return flat

    # -- defaults for a torch.nn.Module ---------------------------------------------------------------
    def _default_sleep(self, level: int) -> int:
        """A plain module's sleep; the bytes it freed: level 2 every non-empty tensor it drops (after level 1
        they are on the host), level 1 the device bytes it moves to the host (none on a CPU)."""
        tensors = list(_module_tensors(torch_module(self.model)))
        if level == 2:
            freed = sum(t.numel() * t.element_size() for t in tensors)
            self.loader.drop()
            return freed
        freed = sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu")
        for tensor in tensors:
            tensor.data = tensor.data.to("cpu")
        return freed

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


def _module_tensors(module: Any) -> Any:
    """Every distinct parameter and buffer of `module`, once each (tied weights counted once)."""
    seen: set[int] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor
