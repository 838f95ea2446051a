"""The same-node lane's codec: cloudpickle, with large CPU tensors (and CUDA tensors, as IPC handles)
out of band in shared-memory files, so one copy reaches every rank (see actors/ipc.py).

    encoded = encode(obj)                 # Encoded(body, fds): the pickle and the memfds it refers to
    joined = join([encoded, ...])         # several requests of one batch as one body
    obj = decode(body, fds, private=True) # the receiving end (maps the memfds, copy-on-write)

Both ends use it: the driver's lane and the rank's request thread (actors/rank_actor.py).
"""

from __future__ import annotations

import errno
import io
import logging
import mmap
import os
import pickle
import resource
import struct
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from ray import cloudpickle

logger = logging.getLogger(__name__)

LARGE_TENSOR_BYTES = 1 << 20  # CPU tensors this large travel in shared memory, not in the message
BODY_IN_MEMFD_BYTES = 256 << 10  # message bodies beyond this travel in shared memory too
HEADER = struct.Struct("!IBQQ")  # file descriptors, body-in-memfd flag, meta bytes, body bytes
MAX_FDS = 253  # SCM_RIGHTS limit per message
MAX_BATCH_FDS = MAX_FDS - 1  # tensor files one batch message may carry (one more for a large body)
_JOINED = b"PHYB"  # a joined batch body starts with this (a pickle starts with its PROTO opcode)
_PART = struct.Struct("!QI")  # one joined part: body bytes, file descriptors
SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "memfd_create")


# -- encoding: cloudpickle, with large CPU tensors in memfd files -----------------------------------
class _Budget:
    """Tensor memfds held by live `Encoded` payloads in this process, at most a quarter of its
    descriptor limit: requests queued with large tensors never run the process out of descriptors
    (beyond the budget a tensor travels in the message body, which is one memfd while it is sent)."""

    def __init__(self) -> None:
        self._lock, self.held = threading.Lock(), 0

    def take(self) -> bool:
        with self._lock:
            if self.held >= resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4:
                return False
            self.held += 1
            return True

    def give_back(self, count: int) -> None:
        with self._lock:
            self.held -= count


_BUDGET = _Budget()


@dataclass(eq=False)
class Encoded:
    """A payload pickled once; `fds` are memfd files holding its large tensors (closed when this is
    dropped, or by `close`; they count against the process's `_BUDGET`)."""

    body: bytes
    fds: list[int]

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _release, list(self.fds)) if self.fds else None

    def close(self) -> None:
        """Close the tensor files now (every receiver has its own descriptor or mapping by then)."""
        if self._finalizer is not None:
            self._finalizer()
        self.fds = []  # never send a closed descriptor's number (it may name another file by now)

    def take(self) -> list[int]:
        """Hand the tensor files to a new owner (`join`): this one no longer closes them."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        fds, self.fds = self.fds, []
        return fds


def _release(fds: list[int]) -> None:
    """Close tensor memfds and give them back to the budget."""
    count = len(fds)
    close_fds(fds)
    _BUDGET.give_back(count)


def close_fds(fds: list[int]) -> None:
    """Close every descriptor of `fds` and empty the list (so a second call closes nothing)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _persistent_id(pickler: Any, obj: Any) -> Any:
    """CPU tensors by their bytes: large ones in a memfd (one copy), small ones inline (torch's own
    pickling goes through `torch.save`, ~50 us for a 16-element tensor). CUDA tensors by a CUDA IPC
    handle (no copy): the receiver maps the sender's memory, valid while the sender lives."""
    if type(obj) is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized:
        return None
    if obj.device.type == "cuda":
        if pickler.cuda_ipc:
            return _cuda_handle(obj)
        obj = obj.detach().cpu()  # the receiver sees no GPU: it gets a CPU copy
    if obj.device.type != "cpu":
        return None
    dtype, shape = str(obj.dtype).removeprefix("torch."), tuple(obj.shape)
    if obj.numel() * obj.element_size() < LARGE_TENSOR_BYTES or len(pickler.fds) >= MAX_FDS - 1 \
            or not _BUDGET.take():
        return ("bytes", _flat_bytes(obj).tobytes(), dtype, shape, obj.requires_grad)
    try:
        pickler.fds.append(bytes_file(memoryview(_flat_bytes(obj)), "phyai-tensor"))
    except BaseException:
        _BUDGET.give_back(1)
        raise
    return ("memfd", len(pickler.fds) - 1, dtype, shape, obj.requires_grad)


class _Pickler(pickle.Pickler):
    """The fast pickler (C); payloads it cannot pickle (lambdas, classes defined in functions) go
    through `_CloudPickler`."""

    def __init__(self, file: io.BytesIO, fds: list[int], cuda_ipc: bool) -> None:
        super().__init__(file, protocol=5)
        self.fds, self.cuda_ipc = fds, cuda_ipc

    persistent_id = _persistent_id


class _CloudPickler(cloudpickle.CloudPickler):
    def __init__(self, file: io.BytesIO, fds: list[int], cuda_ipc: bool) -> None:
        super().__init__(file, protocol=5)
        self.fds, self.cuda_ipc = fds, cuda_ipc

    persistent_id = _persistent_id


def _cuda_handle(tensor: torch.Tensor) -> Any:
    """torch's CUDA IPC reduction (its reference counting keeps the memory until every receiver
    dropped it); None (torch's own pickling, a copy through the CPU) where it does not apply."""
    if tensor.requires_grad and not tensor.is_leaf:
        return None
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    return ("cuda", rebuild, args, None, None)


def _flat_bytes(tensor: torch.Tensor) -> Any:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def bytes_file(data: memoryview, name: str) -> int:
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise _out_of_descriptors(exc) from exc
    try:
        os.ftruncate(fd, data.nbytes)
        done = 0
        while done < data.nbytes:
            done += os.pwrite(fd, data[done:done + (1 << 30)], done)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _out_of_descriptors(exc: OSError) -> OSError:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        opened = len(os.listdir("/proc/self/fd"))
    except OSError:
        opened = -1
    return OSError(exc.errno, f"{os.strerror(exc.errno)}: no file descriptor left for the shared-memory file of "
                   f"a large tensor or message ({opened} open in this process, limit {soft}); raise the limit "
                   "(`ulimit -n`, RLIMIT_NOFILE) or hold fewer large requests at once (max_queued_requests)")


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, fds: list[int], private: bool) -> None:
        super().__init__(file)
        self._fds, self._private = fds, private

    def persistent_load(self, pid: Any) -> Any:
        kind, where, dtype, shape, requires_grad = pid
        if kind == "cuda":  # (rebuild, args) of torch's CUDA IPC reduction
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            if where is not rebuild_cuda_tensor:
                raise pickle.UnpicklingError(f"unexpected CUDA tensor rebuild function {where!r:.100}")
            return where(*dtype)
        if kind == "memfd" and isinstance(where, int) and 0 <= where < len(self._fds):
            data: Any = map_fd(self._fds[where], self._private)
        elif kind == "bytes" and isinstance(where, bytes):
            data = bytearray(where)
        else:
            raise pickle.UnpicklingError(f"unknown tensor reference {pid!r:.100}")
        if not len(data):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        else:
            tensor = torch.frombuffer(data, dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)
        return tensor.requires_grad_() if requires_grad else tensor


def map_fd(fd: int, private: bool) -> mmap.mmap:
    size = os.fstat(fd).st_size
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def encode(obj: Any, *, cuda_ipc: bool = True) -> Encoded:
    """Pickle `obj` once; large CPU tensors go into memfd files, CUDA tensors as CUDA IPC handles
    (`cuda_ipc=False`, for a receiver that sees no GPU: as CPU copies). Raises what pickling raises."""
    for pickler in (_Pickler, _CloudPickler):
        fds: list[int] = []
        buffer = io.BytesIO()
        try:
            pickler(buffer, fds, cuda_ipc).dump(obj)
            return Encoded(buffer.getvalue(), fds)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            _release(fds)
            if pickler is _CloudPickler:
                raise
            logger.debug("fast pickling failed (%s); using cloudpickle", exc)
        except BaseException:
            _release(fds)
            raise
    raise AssertionError("unreachable")


def join(parts: Sequence[Encoded]) -> Encoded:
    """Several encoded payloads as one message body (a batch: written once, decoded as a list).

    Layout: `PHYB`, the part count, then (body bytes, descriptor count) per part, then the bodies;
    the descriptors follow in part order. The joined message owns the parts' descriptors."""
    header = [_JOINED, struct.pack("!I", len(parts))]
    header += [_PART.pack(len(p.body), len(p.fds)) for p in parts]
    fds = [fd for p in parts for fd in p.take()]
    if len(fds) > MAX_BATCH_FDS:
        _release(fds)
        raise ValueError(f"a batch carries {len(fds)} shared-memory tensors, more than one message can pass "
                         f"({MAX_BATCH_FDS}); the batcher bounds this, so this is a bug")
    return Encoded(b"".join(header + [p.body for p in parts]), fds)


def decode(body: Any, fds: list[int], *, private: bool) -> Any:
    """The object `encode` pickled (a list for a `join`ed body); closes `fds` and empties the list (the
    mappings keep the pages)."""
    try:
        if bytes(body[:len(_JOINED)]) == _JOINED:
            return _decode_joined(memoryview(body), fds, private)
        return _Unpickler(io.BytesIO(body), fds, private).load()
    finally:
        close_fds(fds)


def _decode_joined(view: memoryview, fds: list[int], private: bool) -> list:
    (count,) = struct.unpack_from("!I", view, len(_JOINED))
    offset = len(_JOINED) + 4
    sizes = [_PART.unpack_from(view, offset + i * _PART.size) for i in range(count)]
    offset += count * _PART.size
    if offset + sum(n for n, _ in sizes) != len(view) or sum(k for _, k in sizes) != len(fds):
        raise pickle.UnpicklingError(f"a joined message of {count} part(s) does not match its {len(view)} bytes "
                                     f"and {len(fds)} descriptor(s)")
    out, first_fd = [], 0
    for nbytes, nfds in sizes:
        part = io.BytesIO(view[offset:offset + nbytes])
        out.append(_Unpickler(part, fds[first_fd:first_fd + nfds], private).load())
        offset, first_fd = offset + nbytes, first_fd + nfds
    return out


