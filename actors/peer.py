"""Same-node request sockets whose two ends prove who they are before a byte is unpickled.

An abstract Unix socket has no file permissions and its name is listed in `/proc/net/unix`, so
any local process may connect to it, or bind a name the moment it is free. Both ends therefore
check the kernel's record of the other process (`SO_PEERCRED`: pid and uid, fixed at connect /
listen time, not forgeable) against what Ray told them:

    rank:   listen() -> (address, token)       open_ipc(engine_pid) returns them over Ray
            accept_engine(sock, token, pid)    accepts until a connection FROM the engine's pid,
                                               same uid, sends the token; every other connection is
                                               closed unread and the listener stays open (its name
                                               is never free for another process to bind)
    engine: connect_rank(address, token, pid)  connects, checks the listener IS the rank's process,
                                               only then sends the token

A connection that fails these checks is closed before anything is read from it; the engine side
raises `PeerError`, which the replica reports as a startup failure (it never falls back to another
transport with a foreign process on the line).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import time
from typing import Any

logger = logging.getLogger(__name__)

ACCEPT_TIMEOUT_S = 60.0
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PeerError(ConnectionError):
    """The other end of a request socket is not the process Ray says it should be."""


def credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of `sock`, as the kernel recorded them."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def _mismatch(sock: socket.socket, pid: int) -> str | None:
    """Why `sock`'s peer is not process `pid` of this user, or None when it is."""
    found_pid, found_uid = credentials(sock)
    if found_pid == pid and found_uid == os.getuid():
        return None
    return f"pid {found_pid} uid {found_uid}, expected pid {pid} uid {os.getuid()}"


def listen() -> tuple[socket.socket, str, bytes]:
    """A listening Unix socket (random abstract name), its address, and the token the engine sends first."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = "\0phyai-ray-" + secrets.token_hex(12)
    sock.bind(address)
    sock.listen(8)
    return sock, address, secrets.token_bytes(16)


def accept_engine(sock: socket.socket, token: bytes, engine_pid: int,
                  timeout_s: float = ACCEPT_TIMEOUT_S) -> socket.socket:
    """The engine's connection to listener `sock`: the first one from process `engine_pid` (this
    user) that sends `token` within `timeout_s`. Closes the listener when done, either way."""
    deadline = time.monotonic() + timeout_s
    refused: list[str] = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"the engine (pid {engine_pid}) did not connect its request socket within "
                                f"{timeout_s:.0f} s; refused {len(refused)} other connection(s): {refused[:4]}")
            sock.settimeout(left)
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                continue
            why = _mismatch(conn, engine_pid) or _token_mismatch(conn, token, deadline)
            if why is None:
                conn.settimeout(None)
                return conn
            refused.append(why)
            logger.warning("refused a connection to the request socket: %s", why)
            conn.close()
    finally:
        sock.close()


def _token_mismatch(conn: socket.socket, token: bytes, deadline: float) -> str | None:
    """Read the token from a verified peer (bounded by the deadline); why it is wrong, or None."""
    conn.settimeout(max(deadline - time.monotonic(), 0.001))
    got = b""
    try:
        while len(got) < len(token):
            chunk = conn.recv(len(token) - len(got))
            if not chunk:
                break
            got += chunk
    except OSError as exc:
        return f"reading its token failed ({type(exc).__name__}: {exc})"
    return None if secrets.compare_digest(got, token) else "it sent the wrong token"


def connect_rank(address: Any, token: bytes, rank_pid: int, timeout_s: float) -> socket.socket:
    """A socket to the rank's listener at `address`, once the kernel says the listener is process
    `rank_pid` of this user; then `token` is sent. Raises `PeerError` (nothing sent) otherwise."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address)
        why = _mismatch(sock, rank_pid)
        if why is not None:
            raise PeerError(f"the request socket {address!r} is held by another process ({why}); a local "
                            "process took over the rank's socket name: not connecting (nothing was sent)")
        sock.sendall(token)
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise
