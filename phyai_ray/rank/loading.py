"""Loading a weight update on one rank: checked before anything changes, then bucket by bucket.

    check(buckets)          every name, shape and dtype against the model's specs; nothing is
                            received and nothing changes (the engine asks every rank first)
    load(buckets, receive)  receive one bucket, load its tensors, then the next (a broadcast
                            goes into one reused buffer): the peak is the model plus about one
                            bucket (`bucket_bytes`, or the largest tensor if larger), never a
                            second copy of the model
    drain(buckets, receive) receive and drop every broadcast bucket: a refused update over gloo /
                            nccl still completes the trainer's send, so the transfer group stays
                            in step for the next update

A model with `weight_specs` may also define `weight_note(name, shape, dtype) -> str | None`: asked
about each tensor that does not match its specs, it returns why it accepts it anyway (a tied head
skipped, a buffer skipped, a dtype cast) or None to refuse it; its `load_weights` then receives
those tensors too and does what the note says. The notes, each with the tensors it covers, are the
check's `notes` (the update's report lists them).

The model's specs are `weight_specs()` of the per-rank model, `{name: (full shape, dtype)}` of
the tensors the trainer sends (a model that defines it gets `load_weights` once per bucket, and
must copy what it keeps: the tensors are views of the bucket's buffer); for
a plain `torch.nn.Module` without `load_weights`, its parameters and buffers (the ones dropped by
`sleep(level=2)` keep the shape they had). A model with `load_weights` and no `weight_specs`
cannot be checked here: its update is received whole and given to `load_weights` at once (its own
checks apply; an error there fails the replica, whose weights may be half-changed).
"""

from __future__ import annotations

from typing import Any, Callable

from phyai_ray.rank.receive import Bucket, WeightCheck, empty_flat, unflatten

Spec = tuple[tuple[int, ...], str]
EVERY_WEIGHT = "<every weight: the model's own sleep(level=2) dropped them>"


def torch_module(model: Any) -> Any:
    """The model itself or its `module` attribute, if either is a `torch.nn.Module`."""
    import torch

    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class WeightLoader:
    """Checks and loads the weight updates of one rank's model (see the module docstring)."""

    def __init__(self, model: Any, ctx: Any) -> None:
        self.model, self.ctx = model, ctx
        self._dropped: dict[str, Spec] = {}  # what sleep(level=2) emptied: name -> its spec before
        self.unloaded: set[str] = set()  # emptied by sleep(level=2) and not loaded since

    # -- specs and checks ----------------------------------------------------------------------
    def specs(self) -> dict[str, Spec] | None:
        """{name: (shape, dtype)} an update is checked against; None when the model cannot say."""
        declared = getattr(self.model, "weight_specs", None)
        if callable(declared):
            return {name: (tuple(int(d) for d in shape), dtype_name(dtype))
                    for name, (shape, dtype) in declared().items()}
        module = torch_module(self.model)
        if hasattr(self.model, "load_weights") or module is None:
            return None
        return {name: self._dropped.get(name, (tuple(t.shape), dtype_name(t.dtype)))
                for name, t in _tensors(module).items()}

    def check(self, buckets: tuple[Bucket, ...]) -> WeightCheck:
        """Every mismatch between the update and the model, one line each (empty: accepted)."""
        if not hasattr(self.model, "load_weights") and torch_module(self.model) is None:
            return WeightCheck(self.ctx.rank, (
                f"per-rank model {type(self.model).__name__} has no load_weights(weights) and is not a "
                "torch.nn.Module; define load_weights (and weight_specs) to receive weights",))
        specs = self.specs()
        if specs is None:
            return WeightCheck(self.ctx.rank)
        note = getattr(self.model, "weight_note", None)
        problems: list[str] = []
        noted: dict[str, list[str]] = {}  # note -> the tensors it covers
        for bucket in buckets:
            for meta in bucket.tensors:
                problem = _mismatch(meta.name, tuple(meta.shape), bucket.dtype, specs)
                why = note(meta.name, tuple(meta.shape), bucket.dtype) if problem and callable(note) else None
                if why:
                    noted.setdefault(why, []).append(meta.name)
                elif problem:
                    problems.append(problem)
        return WeightCheck(self.ctx.rank, tuple(problems), tuple(_listed(why, names) for why, names in noted.items()))

    # -- loading -------------------------------------------------------------------------------
    def load(self, buckets: tuple[Bucket, ...], receive: Callable[..., Any]) -> None:
        """Load `buckets` (already checked); one at a time unless the model needs the update whole."""
        if self.specs() is None:  # load_weights without weight_specs: it sees the whole update at once
            weights: list[tuple[str, Any]] = []
            for bucket in buckets:
                weights += unflatten(bucket, receive(bucket))
            self.model.load_weights(weights)
            self.unloaded.clear()
            return
        scratch: dict[str, Any] | None = None if hasattr(self.model, "load_weights") else {}
        for bucket in buckets:  # only the default loader, which copies, may get a reused buffer
            into = None if scratch is None else _reused(scratch, bucket, self.ctx.device)
            self._apply(list(unflatten(bucket, receive(bucket, into))))

    def drain(self, buckets: tuple[Bucket, ...], receive: Callable[..., Any]) -> None:
        """Receive and drop every bucket the trainer broadcasts (object_store / cuda_ipc: nothing to do)."""
        scratch: dict[str, Any] = {}
        for bucket in buckets:
            if bucket.ref is None and bucket.ipc is None:
                receive(bucket, _reused(scratch, bucket, self.ctx.device))

    def _apply(self, weights: list[tuple[str, Any]]) -> None:
        self.unloaded.discard(EVERY_WEIGHT)
        self.unloaded -= {name for name, _ in weights}
        if hasattr(self.model, "load_weights"):
            self.model.load_weights(weights)
            return
        import torch

        own = _tensors(torch_module(self.model))
        with torch.no_grad():
            for name, tensor in weights:
                target = own[name]
                if target.numel() == 0 and tensor.numel() > 0:  # dropped by sleep(level=2): a copy of its own
                    target.data = tensor.to(self.ctx.device).clone()
                else:
                    target.copy_(tensor)

    # -- sleep(level=2) ----------------------------------------------------------------------------
    def drop(self) -> None:
        """Empty every parameter and buffer of a plain module, remembering their specs."""
        import torch

        module = torch_module(self.model)
        if module is None:
            return
        for name, tensor in _tensors(module).items():
            if tensor.numel() > 0:
                self._dropped[name] = (tuple(tensor.shape), dtype_name(tensor.dtype))
                self.unloaded.add(name)
            tensor.data = torch.empty(0, dtype=tensor.dtype)

    def dropped_by_model(self) -> None:
        """The model's own sleep(level=2) dropped its weights: waking needs an update first."""
        self.unloaded.add(EVERY_WEIGHT)

    def unloaded_report(self) -> WeightCheck:
        return WeightCheck(self.ctx.rank, tuple(sorted(self.unloaded)))


def _reused(scratch: dict[str, Any], bucket: Bucket, device: Any) -> Any:
    """A buffer for a broadcast bucket, reused from bucket to bucket of one dtype (one allocation per
    update and dtype, at the largest bucket's size, instead of one per bucket); None for the others."""
    if bucket.ref is not None or bucket.ipc is not None:
        return None
    buffer = scratch.get(bucket.dtype)
    if buffer is None or buffer.numel() < bucket.numel:
        scratch[bucket.dtype] = buffer = empty_flat(bucket, device)
    return buffer[:bucket.numel]


def _tensors(module: Any) -> dict[str, Any]:
    return dict(module.named_parameters()) | dict(module.named_buffers())


def _listed(why: str, names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{why}: {shown}"


def _mismatch(name: str, shape: tuple[int, ...], dtype: str, specs: dict[str, Spec]) -> str | None:
    want = specs.get(name)
    if want is None:
        return f"{name!r} is not a weight of the model (it has {len(specs)}, e.g. {sorted(specs)[:3]})"
    if shape != want[0]:
        return f"{name!r}: shape {list(shape)}, the model's is {list(want[0])}"
    if dtype != want[1]:
        return f"{name!r}: dtype {dtype}, the model's is {want[1]} (cast it before sending)"
    return None
