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

Threads: `send` is called by one thread at a time, in dispatch order (the rank pipeline's
`send_launches`, outside the replica's lock), and never blocks: it writes with MSG_DONTWAIT and
leaves what did not fit to the lane's writer thread, in order. The writer never blocks on one rank
either: a rank busy in a collective reads its next message only after its peers got theirs. One
reader thread per lane waits on every rank's socket; replies come back per rank in the order sent. A
rank whose socket closes (its process exited) ends the lane with `on_broken(rank, exc)`.
"""

from __future__ import annotations

import logging
import os
import pickle
import selectors
import socket
import threading
import weakref
from collections import deque
from typing import Any, Callable, Sequence

from actors import fetch, peer
from actors.ipc_codec import MAX_BATCH_FDS, SUPPORTED, Encoded, close_fds, decode, encode, join
from actors.ipc_wire import cuda_visible, frame, poll_writable, recv_frame, send_some
from actors.lane import BoundedLane
from actors.protocol import LaneRequest

logger = logging.getLogger(__name__)
__all__ = ["SUPPORTED", "IpcLane"]  # SUPPORTED: whether this platform has the lane (Linux, memfd)


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

    name = "ipc"
    max_batch_weight = MAX_BATCH_FDS  # tensor files one batch message may carry

    def weight(self, payload: Any) -> int:
        """Tensor files a prepared payload carries (counted against max_batch_weight)."""
        return len(payload.fds) if isinstance(payload, Encoded) else 0

    def batch(self, payloads: list) -> Encoded:
        return self.join(payloads)

    def __init__(self, actors: Sequence[Any], *, capacity: int, name: str, timeout_s: float,
                 on_reply: Callable[[Any, int, Any], None], on_broken: Callable[[int, BaseException], None],
                 on_unsent: Callable[[Any, BaseException], None]) -> None:
        super().__init__(capacity, on_unsent)
        self._on_reply, self._on_broken = on_reply, on_broken
        self._name = name
        self._prepared: weakref.WeakSet[Encoded] = weakref.WeakSet()  # closed with the lane, wherever they wait
        here_cuda = cuda_visible()
        opened = fetch.get([actor.open_ipc.remote(here_cuda, os.getpid()) for actor in actors], timeout=timeout_s)
        self.cuda_ipc = all(rank_cuda for _, _, rank_cuda, _ in opened)  # CUDA request tensors go by handle
        self._socks: list[socket.socket] = []
        try:  # each rank's listener must be that rank's process (its pid comes over Ray): `actors.peer`
            for address, token, _, pid in opened:
                self._socks.append(peer.connect_rank(address, token, pid, timeout_s))
        except BaseException:
            for sock in self._socks:
                sock.close()
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

    def _pack(self, request: LaneRequest) -> tuple[memoryview, list[int], Encoded]:
        """No lock held: the framed bytes (a large body copied into its memfd here) and descriptors."""
        payload = request.payload if isinstance(request.payload, Encoded) else \
            encode(request.payload, cuda_ipc=self.cuda_ipc)
        meta = pickle.dumps((request.seq, request.kind, request.reply_ranks, request.window))
        data, fds = frame(meta, payload)
        return data, fds, payload

    def _write(self, tag: Any, packed: tuple[memoryview, list[int], Encoded]) -> BaseException | None:
        """Lock held: queue the framed message for every rank and write what each socket takes now."""
        data, fds, payload = packed
        if self._closed:
            close_fds([fd for fd in fds if fd not in payload.fds])
            return None
        message = _Message(tag, data, fds, payload, len(self._socks))
        self._in_flight += 1
        for rank, sock in enumerate(self._socks):
            self._order[rank].append(message)
            queue = self._unwritten[rank]
            offset = 0
            if not queue:  # nothing ahead of it for this rank: write what the socket takes now
                try:
                    offset = send_some(sock, message, 0)
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
            ready = poll_writable([self._socks[rank] for rank in pending], 1.0)
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
                item[1] = send_some(self._socks[rank], message, offset)
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
        # Shut the sockets down first: that wakes the reader's select (EOF) and the writer's poll at
        # once, where closing a socket under them would leave both asleep until their 1 s timeouts.
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        for sock in self._socks:
            sock.close()


