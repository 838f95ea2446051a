"""`IpcLane`: a replica's same-node request path over Unix-domain sockets, large tensors in shared memory.

    driver --LaneRequest--> [one Unix socket per rank] --> the rank's request thread
           <--RankReply--- [the same socket]           <-- RankActor runs it in socket order

Why not Ray's own shared-memory channels (a Compiled Graph)? Their readers wait by polling
(`PlasmaObjectHeader::ReadAcquire` loops on `sched_yield`), so every idle rank and every reply
reader holds a CPU core. Here every waiting thread blocks in the kernel: an idle replica costs no
CPU, and a request costs one small socket write per rank and one read per reply.

Large tensors: a CPU tensor of `LARGE_TENSOR_BYTES` or more is copied once into an anonymous
shared-memory file (`memfd`), and its file descriptor travels with the message (SCM_RIGHTS). Every
receiver maps the same pages: a request tensor reaches every rank with one copy on the driver, a
result tensor reaches the driver with one copy on the rank (as `ray.put` + `ray.get` would). Ranks
map request tensors copy-on-write, so a plugin that writes into its request changes only its own
view. A message body larger than `BODY_IN_MEMFD_BYTES` travels the same way, so a socket write
never waits for long.

Threads: `send` runs under the replica scheduler's lock and never blocks: it writes with
MSG_DONTWAIT and leaves what did not fit to the lane's writer thread, in order. The writer never
blocks on one rank either: a rank busy in a collective reads its next message only after its
peers got theirs. One reader thread
per lane waits on every rank's socket; replies come back per rank in the order sent. A rank whose
socket closes (its process exited) ends the lane with `on_broken(rank, exc)`.
"""

from __future__ import annotations

import errno
import io
import logging
import mmap
import os
import pickle
import resource
import select
import selectors
import socket
import struct
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from ray import cloudpickle

from actors import peer
from actors.lane import BoundedLane
from actors.protocol import LaneRequest

logger = logging.getLogger(__name__)

LARGE_TENSOR_BYTES = 1 << 20  # CPU tensors this large travel in shared memory, not in the message
BODY_IN_MEMFD_BYTES = 256 << 10  # message bodies beyond this travel in shared memory too
_HEADER = struct.Struct("!IBQQ")  # file descriptors, body-in-memfd flag, meta bytes, body bytes
_MAX_FDS = 253  # SCM_RIGHTS limit per message
MAX_BATCH_FDS = _MAX_FDS - 1  # tensor files one batch message may carry (one more for a large body)
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
    if obj.numel() * obj.element_size() < LARGE_TENSOR_BYTES or len(pickler.fds) >= _MAX_FDS - 1 \
            or not _BUDGET.take():
        return ("bytes", _flat_bytes(obj).tobytes(), dtype, shape, obj.requires_grad)
    try:
        pickler.fds.append(_bytes_file(memoryview(_flat_bytes(obj)), "phyai-tensor"))
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


def _bytes_file(data: memoryview, name: str) -> int:
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
            data: Any = _map(self._fds[where], self._private)
        elif kind == "bytes" and isinstance(where, bytes):
            data = bytearray(where)
        else:
            raise pickle.UnpicklingError(f"unknown tensor reference {pid!r:.100}")
        if not len(data):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        else:
            tensor = torch.frombuffer(data, dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)
        return tensor.requires_grad_() if requires_grad else tensor


def _map(fd: int, private: bool) -> mmap.mmap:
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


# -- framing --------------------------------------------------------------------------------------
def frame(meta: bytes, encoded: Encoded) -> tuple[memoryview, list[int]]:
    """The bytes of one message and the descriptors sent with its first byte (a big body goes in a memfd)."""
    fds, body, in_fd = list(encoded.fds), encoded.body, 0
    if len(body) > BODY_IN_MEMFD_BYTES:
        fds.append(_bytes_file(memoryview(body), "phyai-message"))
        body, in_fd = b"", 1
    return memoryview(b"".join((_HEADER.pack(len(fds), in_fd, len(meta), len(body)), meta, body))), fds


def send_frame(sock: socket.socket, data: memoryview, fds: list[int]) -> None:
    """Write one whole message (blocking)."""
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_bytes(fds))] if fds else [])
    while sent < len(data):
        sent += sock.send(data[sent:])


def send_encoded(sock: socket.socket, meta: bytes, encoded: Encoded) -> None:
    """Frame and write `encoded` (blocking), then close every descriptor it took."""
    data, fds = frame(meta, encoded)
    try:
        send_frame(sock, data, fds)
    finally:
        close_fds([fd for fd in fds if fd not in encoded.fds])
        encoded.close()


def recv_frame(sock: socket.socket) -> tuple[bytes, Any, list[int]] | None:
    """One message: (meta, body, fds) with the body's memfd already read; None at a clean end."""
    head, fds = _recv_head(sock)
    if head is None:
        return None
    try:
        count, in_fd, meta_len, body_len = _HEADER.unpack(head)
        if len(fds) != count:
            raise ConnectionError(f"a message announced {count} file descriptor(s) and carried {len(fds)}")
        meta, body = _recv_exactly(sock, meta_len), _recv_exactly(sock, body_len)
        if in_fd:
            fd = fds[-1]
            body = _map(fd, private=True) if os.fstat(fd).st_size else b""
            os.close(fds.pop())
    except BaseException:
        close_fds(fds)
        raise
    return meta, body, fds


def _recv_head(sock: socket.socket) -> tuple[bytes | None, list[int]]:
    space = socket.CMSG_SPACE(_MAX_FDS * 4)
    data, ancdata, _, _ = sock.recvmsg(_HEADER.size, space, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    fds = [fd for level, kind, raw in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
           for fd in struct.unpack(f"{len(raw) // 4}i", raw[:len(raw) - len(raw) % 4])]
    if not data:
        close_fds(fds)
        return None, []
    if len(data) < _HEADER.size:
        data += _recv_exactly(sock, _HEADER.size - len(data))
    return data, fds


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    if n == 0:
        return b""
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the connection closed in the middle of a message ({got} of {n} bytes)")
        got += k
    return bytes(out)


def _send_some(sock: socket.socket, message: Any, offset: int) -> int:
    """One non-blocking write of `message` from `offset`; the new offset. Descriptors go with byte 0."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_bytes(message.fds))] if offset == 0 and message.fds else []
    try:
        return offset + sock.sendmsg([message.data[offset:]], ancillary, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return offset


def _writable(socks: list[socket.socket], timeout_s: float) -> list[bool]:
    """Which of `socks` take a write now (or have failed: the write then says why), waiting up to
    `timeout_s` in the kernel. `poll`, not `select`: descriptors may be beyond 1024."""
    poller = select.poll()
    for sock in socks:
        try:
            poller.register(sock, select.POLLOUT)
        except (OSError, ValueError):  # closed under us: close() or the reader says why
            return [True] * len(socks)
    ready = {fd for fd, _ in poller.poll(timeout_s * 1000)}  # POLLOUT, POLLERR or POLLHUP
    return [sock.fileno() in ready for sock in socks]


def _fd_bytes(fds: list[int]) -> bytes:
    return struct.pack(f"{len(fds)}i", *fds)


def cuda_visible() -> bool:
    """Whether this process can open CUDA IPC handles (it sees a GPU)."""
    return torch.cuda.is_available()


# -- the driver's end -----------------------------------------------------------------------------
class _Message:
    """One request being written: its bytes and descriptors stay until every rank has it, then the
    descriptors close (each rank holds its own copy of them, or its mapping)."""

    __slots__ = ("tag", "data", "fds", "payload", "unwritten", "waiting")

    def __init__(self, tag: Any, data: memoryview, fds: list[int], payload: Encoded, ranks: int) -> None:
        self.tag, self.data, self.fds, self.payload = tag, data, fds, payload
        self.unwritten = ranks  # ranks that do not have the whole message yet
        self.waiting = ranks  # ranks that have not replied yet

    def written(self) -> None:
        """One more rank has the whole message; after the last, close its descriptors."""
        self.unwritten -= 1
        if self.unwritten == 0:
            close_fds([fd for fd in self.fds if fd not in self.payload.fds])
            self.payload.close()
            self.fds, self.data = [], memoryview(b"")


class IpcLane(BoundedLane):
    """Send `LaneRequest`s to every rank of one replica over its sockets and read their replies."""

    def __init__(self, actors: Sequence[Any], *, capacity: int, name: str, timeout_s: float,
                 on_reply: Callable[[Any, int, Any], None], on_broken: Callable[[int, BaseException], None],
                 on_unsent: Callable[[Any, BaseException], None]) -> None:
        import ray

        super().__init__(capacity, on_unsent)
        self._on_reply, self._on_broken = on_reply, on_broken
        self._name = name
        self._prepared: weakref.WeakSet[Encoded] = weakref.WeakSet()  # closed with the lane, wherever they wait
        here_cuda = cuda_visible()
        opened = ray.get([actor.open_ipc.remote(here_cuda, os.getpid()) for actor in actors], timeout=timeout_s)
        self.cuda_ipc = all(rank_cuda for _, _, rank_cuda, _ in opened)  # CUDA request tensors go by handle
        self._socks: list[socket.socket] = []
        try:  # each rank's listener must be that rank's process (its pid comes over Ray): `actors.peer`
            for address, token, _, pid in opened:
                self._socks.append(peer.connect_rank(address, token, pid, timeout_s))
        except BaseException:
            self._close_sockets()
            raise
        self._writable = threading.Condition(self._lock)
        self._order: list[deque[_Message]] = [deque() for _ in actors]  # written, reply awaited, per rank
        self._unwritten: list[deque[list]] = [deque() for _ in actors]  # [message, bytes sent], per rank
        self._in_flight = 0
        self._threads = [threading.Thread(target=self._read_loop, name=f"{name}-ipc-replies", daemon=True),
                         threading.Thread(target=self._write_loop, name=f"{name}-ipc-writer", daemon=True)]
        for thread in self._threads:
            thread.start()

    @property
    def in_flight(self) -> int:
        """Messages written whose replies are not all read yet."""
        return self._in_flight

    def prepare(self, payload: Any) -> Encoded:
        """`payload` pickled once for every rank, in the caller's thread (large tensors in shared
        memory). Its descriptors close when every rank has it, or with the lane, whichever comes
        first. Raises TypeError when it does not pickle, OSError when descriptors run out."""
        try:
            encoded = encode(payload, cuda_ipc=self.cuda_ipc)
        except OSError:
            raise
        except Exception as exc:
            where = self._name.removeprefix("phyai-").replace("-", " ")
            raise TypeError(f"{where}: the request does not pickle ({type(exc).__name__}: {exc}); requests "
                            "and rpc arguments must be picklable (tensors, numbers, containers, importable "
                            "classes); nothing was queued") from exc
        return self._track(encoded)

    def join(self, parts: Sequence[Encoded]) -> Encoded:
        """A batch's prepared payloads as one message (see `join`), closed with the lane like them."""
        return self._track(join(parts))

    def _track(self, encoded: Encoded) -> Encoded:
        """Close `encoded` with the lane (at once if the lane is already closed)."""
        with self._lock:
            self._prepared.add(encoded)
            closed = self._closed
        if closed:
            encoded.close()
        return encoded

    def _write(self, tag: Any, request: LaneRequest) -> BaseException | None:
        """Lock held. Returns the error of a request that did not serialize (nothing was written)."""
        if self._closed:
            return None
        try:
            payload = request.payload if isinstance(request.payload, Encoded) else \
                encode(request.payload, cuda_ipc=self.cuda_ipc)
            meta = pickle.dumps((request.seq, request.kind, request.reply_ranks, request.window))
            data, fds = frame(meta, payload)
        except Exception as exc:
            return exc
        message = _Message(tag, data, fds, payload, len(self._socks))
        self._in_flight += 1
        for rank, sock in enumerate(self._socks):
            self._order[rank].append(message)
            queue = self._unwritten[rank]
            offset = 0
            if not queue:  # nothing ahead of it for this rank: write what the socket takes now
                try:
                    offset = _send_some(sock, message, 0)
                except OSError:  # the rank is gone: the reader reports it
                    offset = len(message.data)
            if offset == len(message.data):
                message.written()
            else:
                queue.append([message, offset])
                self._writable.notify()
        return None

    def _write_loop(self) -> None:
        """Finish the writes `send` could not complete at once: per rank in order, never blocking on
        one rank while another waits (ranks that share a collective need the same message)."""
        while True:
            with self._lock:
                while not self._closed and not any(self._unwritten):
                    self._writable.wait()
                if self._closed:
                    return
                pending = [rank for rank, queue in enumerate(self._unwritten) if queue]
            ready = _writable([self._socks[rank] for rank in pending], 1.0)
            broken = None
            with self._lock:
                for rank, sock in zip(pending, ready):
                    if sock and broken is None:
                        broken = self._advance(rank)
            if broken is not None:
                self._broken(*broken)
                return

    def _advance(self, rank: int) -> tuple[int, BaseException] | None:
        """Lock held: write what rank's socket takes now, oldest message first; (rank, error) if it broke."""
        queue = self._unwritten[rank]
        while queue:
            item = queue[0]
            message, offset = item
            try:
                item[1] = _send_some(self._socks[rank], message, offset)
            except OSError as exc:
                return None if self._closed else (rank, exc)
            if item[1] < len(message.data):
                return None
            queue.popleft()
            message.written()
        return None

    def _read_loop(self) -> None:
        selector = selectors.DefaultSelector()
        for rank, sock in enumerate(self._socks):
            selector.register(sock, selectors.EVENT_READ, rank)
        try:
            while not self._closed:
                for key, _ in selector.select(timeout=1.0):
                    if not self._read_one(key.data):
                        return
        finally:
            selector.close()

    def _read_one(self, rank: int) -> bool:
        try:
            got = recv_frame(self._socks[rank])
            if got is None:
                raise ConnectionError("the rank closed its request connection")
            _, body, fds = got
            reply = decode(body, fds, private=False)
        except BaseException as exc:
            if not self._closed:
                self._broken(rank, exc)
            return False
        with self._lock:
            if not self._order[rank]:
                unexpected = True
            else:
                unexpected = False
                message = self._order[rank].popleft()
                message.waiting -= 1
                unsent: list = []
                if message.waiting == 0:
                    self._in_flight -= 1
                    unsent = self._flush_backlog()
        if unexpected:
            self._broken(rank, ConnectionError(f"rank {rank} replied with no request outstanding: {reply!r:.200}"))
            return False
        try:
            self._on_reply(message.tag, rank, reply)
            for item in unsent:
                self._on_unsent(*item)
        except Exception:
            logger.exception("handling a rank reply failed")
        return True

    def _broken(self, rank: int, exc: BaseException) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._writable.notify_all()
        self._on_broken(rank, exc)

    def close(self) -> None:
        """Stop both threads, close every socket (the ranks' request threads then end) and every
        shared-memory file a rank did not take: unwritten, in the backlog, or still queued."""
        with self._lock:
            self._closed = True
            self._writable.notify_all()
            unwritten = [message for queue in self._unwritten for message, _ in queue]
            prepared = list(self._prepared)
        for message in unwritten:
            close_fds([fd for fd in message.fds if fd not in message.payload.fds])
            message.fds = []
            message.payload.close()
        for encoded in prepared:
            encoded.close()
        self._close_sockets()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)

    def _close_sockets(self) -> None:
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

