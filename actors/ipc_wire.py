"""The same-node lane's framing: one message = header, meta, body, and the descriptors sent with its
first byte (SCM_RIGHTS) over a Unix-domain socket; both ends use it (see actors/ipc.py).

    data, fds = frame(meta, encoded)      # a body over BODY_IN_MEMFD_BYTES travels in a memfd
    send_encoded(sock, meta, encoded)     # blocking write of one whole message
    meta, body, fds = recv_frame(sock)    # one message, its body's memfd already read; None at the end
"""

from __future__ import annotations

import os
import select
import socket
import struct
from typing import Any

import torch

from actors.ipc_codec import BODY_IN_MEMFD_BYTES, HEADER, MAX_FDS, Encoded, bytes_file, close_fds, map_fd

# -- framing --------------------------------------------------------------------------------------
def frame(meta: bytes, encoded: Encoded) -> tuple[memoryview, list[int]]:
    """The bytes of one message and the descriptors sent with its first byte (a big body goes in a memfd)."""
    fds, body, in_fd = list(encoded.fds), encoded.body, 0
    if len(body) > BODY_IN_MEMFD_BYTES:
        fds.append(bytes_file(memoryview(body), "phyai-message"))
        body, in_fd = b"", 1
    return memoryview(b"".join((HEADER.pack(len(fds), in_fd, len(meta), len(body)), meta, body))), fds


def send_frame(sock: socket.socket, data: memoryview, fds: list[int]) -> None:
    """Write one whole message (blocking)."""
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd_bytes(fds))] if fds else [])
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
        count, in_fd, meta_len, body_len = HEADER.unpack(head)
        if len(fds) != count:
            raise ConnectionError(f"a message announced {count} file descriptor(s) and carried {len(fds)}")
        meta, body = _recv_exactly(sock, meta_len), _recv_exactly(sock, body_len)
        if in_fd:
            fd = fds[-1]
            body = map_fd(fd, private=True) if os.fstat(fd).st_size else b""
            os.close(fds.pop())
    except BaseException:
        close_fds(fds)
        raise
    return meta, body, fds


def _recv_head(sock: socket.socket) -> tuple[bytes | None, list[int]]:
    space = socket.CMSG_SPACE(MAX_FDS * 4)
    data, ancdata, _, _ = sock.recvmsg(HEADER.size, space, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    fds = [fd for level, kind, raw in ancdata if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
           for fd in struct.unpack(f"{len(raw) // 4}i", raw[:len(raw) - len(raw) % 4])]
    if not data:
        close_fds(fds)
        return None, []
    if len(data) < HEADER.size:
        data += _recv_exactly(sock, HEADER.size - len(data))
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


def send_some(sock: socket.socket, message: Any, offset: int) -> int:
    """One non-blocking write of `message` from `offset`; the new offset. Descriptors go with byte 0."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd_bytes(message.fds))] if offset == 0 and message.fds else []
    try:
        return offset + sock.sendmsg([message.data[offset:]], ancillary, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return offset


def poll_writable(socks: list[socket.socket], timeout_s: float) -> list[bool]:
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


def fd_bytes(fds: list[int]) -> bytes:
    return struct.pack(f"{len(fds)}i", *fds)


def cuda_visible() -> bool:
    """Whether this process can open CUDA IPC handles (it sees a GPU)."""
    return torch.cuda.is_available()


