"""`P`: collectives addressed by group name, e.g. `P.all_reduce(x, group="dense_tp")`.

A group of size one is the identity and touches no torch.distributed, so the same plugin code
runs inline, under torchrun and in Ray rank actors. Ranks passed to `broadcast`, `send` and
`recv` are GROUP ranks (0 .. size-1), not global ranks. gloo serves CPU tensors, NCCL CUDA ones.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from phyai_ray.process_groups import active

_REDUCE_OPS = ("sum", "max", "min", "avg")


def _dist():
    import torch.distributed as dist
    return dist


class P:
    """Named-group collectives for plugin code. All methods are static."""

    @staticmethod
    def rank(group: str = "world") -> int:
        """This rank's index inside `group`."""
        return active().group_rank(group)

    @staticmethod
    def size(group: str = "world") -> int:
        """Number of ranks in `group`."""
        return active().size(group)

    @staticmethod
    def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
        """Element-wise reduction over `group` (sum, max, min, avg). Reduces `x` in place and returns it."""
        if op not in _REDUCE_OPS:  # checked on one rank too, so a typo fails inline as well
            raise ValueError(f"all_reduce op {op!r} is not one of {', '.join(_REDUCE_OPS)}")
        groups = active()
        if groups.size(group) == 1:
            return x
        dist = _dist()
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(x, op=ops.get(op, dist.ReduceOp.SUM), group=groups.handle(group))
        if op == "avg":
            x.div_(groups.size(group))
        return x

    @staticmethod
    def all_gather(x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in group-rank order."""
        groups, n = _peers(group)
        if n == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(n)]
        _dist().all_gather(parts, x.contiguous(), group=groups.handle(group))
        return torch.cat(parts, dim=dim)

    @staticmethod
    def reduce_scatter(x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
        """Sum over `group`, then keep this rank's chunk of `dim` (size must divide evenly)."""
        groups, n = _peers(group)
        if n == 1:
            return x
        if x.shape[dim] % n:
            raise ValueError(f"reduce_scatter over {group!r}: dim {dim} of size {x.shape[dim]} "
                             f"does not split into {n} equal chunks")
        if x.is_cuda:
            out = torch.empty_like(x.chunk(n, dim)[0]).contiguous()
            inputs = [c.contiguous() for c in x.chunk(n, dim)]
            _dist().reduce_scatter(out, inputs, group=groups.handle(group))
            return out
        total = P.all_reduce(x.clone(), group)  # gloo has no reduce_scatter
        return total.chunk(n, dim)[groups.group_rank(group)].contiguous()

    @staticmethod
    def broadcast(x: torch.Tensor, group: str, src: int = 0) -> torch.Tensor:
        """Copy group rank `src`'s `x` into every rank's `x` (same shape and dtype everywhere)."""
        groups = active()
        if groups.size(group) == 1:
            return x
        _dist().broadcast(x, src=groups.global_rank(group, src), group=groups.handle(group))
        return x

    @staticmethod
    def send(x: torch.Tensor, dst: int, group: str = "pp") -> None:
        """Send `x` to group rank `dst` (pipeline hand-off)."""
        groups = active()
        _dist().send(x.contiguous(), dst=groups.global_rank(group, dst), group=groups.handle(group))

    @staticmethod
    def recv(x: torch.Tensor, src: int, group: str = "pp") -> torch.Tensor:
        """Receive into the preallocated `x` from group rank `src`; returns `x`."""
        groups = active()
        _dist().recv(x, src=groups.global_rank(group, src), group=groups.handle(group))
        return x

    @staticmethod
    def all_to_all(x: torch.Tensor, group: str, output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Exchange chunks of dim 0: chunk i of `x` goes to group rank i (expert dispatch)."""
        groups = active()
        if groups.size(group) == 1:
            return x
        x = x.contiguous()
        if output_split_sizes is None:
            out = torch.empty_like(x)
        else:
            out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        _dist().all_to_all_single(out, x, output_split_sizes=list(output_split_sizes or []) or None,
                                  input_split_sizes=list(input_split_sizes or []) or None,
                                  group=groups.handle(group))
        return out

    @staticmethod
    def agreed(value: int, op: str = "min", group: str = "world") -> int:
        """The one integer every rank of `group` ends with: the min (max, sum) of the values the ranks
        passed. For what must be decided once for a replica, e.g. its KV pool's blocks: the fewest any
        rank holds, so no rank schedules what another cannot (their collectives would mismatch)."""
        groups = active()
        if groups.size(group) == 1:
            return int(value)
        nccl = _dist().get_backend(groups.handle(group)) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        return int(P.all_reduce(torch.tensor([int(value)], dtype=torch.int64, device=device), group, op).item())

    @staticmethod
    def barrier(group: str = "world") -> None:
        """Wait until every rank of `group` arrives."""
        groups = active()
        if groups.size(group) > 1:
            _dist().barrier(group=groups.handle(group))


def _peers(group: str) -> tuple[Any, int]:
    """The active group set and the size of `group` in it."""
    groups = active()
    return groups, groups.size(group)
