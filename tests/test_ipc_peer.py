"""The same-node request lane against another local process that tries to take it over.

A real second process (`tests/scripts/ipc_intruder.py`) connects to a rank's socket first, or
holds the socket name the engine connects to; the lane must refuse it before unpickling a byte
and still come up (or fail with a clear error).

Run: `.venv/bin/pytest tests/test_ipc_peer.py` (starts one local Ray instance for the session).
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from actors import ipc_codec, ipc_wire, peer

INTRUDER = Path(__file__).parent / "scripts" / "ipc_intruder.py"


class _Intruder:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(INTRUDER), *args], stdout=subprocess.PIPE, text=True)

    def line(self) -> str:
        return self.proc.stdout.readline().strip()


@contextmanager
def _intruder(*args: str) -> Iterator[_Intruder]:
    intruder = _Intruder(*args)
    try:
        yield intruder
    finally:
        intruder.proc.kill()
        intruder.proc.wait(timeout=10)
        intruder.proc.stdout.close()


def _call(sock, method: str):
    """One rpc over a rank's request socket, framed as the engine's lane frames it."""
    meta = pickle.dumps((0, "call", frozenset({0}), 1))
    ipc_wire.send_encoded(sock, meta, ipc_codec.encode((method, (), {})))
    _, body, fds = ipc_wire.recv_frame(sock)
    return ipc_codec.decode(body, fds, private=False)


def test_the_engine_never_sends_its_token_to_a_process_holding_the_rank_socket_name():
    name = "phyai-ray-" + secrets.token_hex(12)
    with _intruder("listen", name) as intruder:
        assert intruder.line() == "listening"
        rank_pid = os.getppid()  # any process but the intruder: the one Ray says listens
        with pytest.raises(peer.PeerError, match=rf"pid {intruder.proc.pid} .*expected pid {rank_pid}"):
            peer.connect_rank("\0" + name, secrets.token_bytes(16), rank_pid, timeout_s=10)
        assert intruder.line() == "received 0"


def test_a_wrong_token_is_refused_the_listener_stays_open_and_a_deadline_ends_the_wait():
    listening, address, token = peer.listen()
    wrong, right = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), socket.socket(socket.AF_UNIX)
    with wrong, right:
        wrong.connect(address)
        wrong.sendall(b"x" * len(token))
        right.connect(address)
        right.sendall(token)
        with peer.accept_engine(listening, token, os.getpid(), timeout_s=10) as conn:
            assert peer.credentials(conn) == (os.getpid(), os.getuid())
        assert wrong.recv(1) == b""  # closed unread
    listening, address, token = peer.listen()
    with socket.socket(socket.AF_UNIX) as late:
        late.connect(address)
        late.sendall(token)  # the right token from a process that is not the engine
        with pytest.raises(peer.PeerError, match=r"did not connect .* within 0 s; refused 1 .*expected pid 1 "):
            peer.accept_engine(listening, token, 1, timeout_s=0.5)


@pytest.mark.ray
def test_a_process_that_connects_first_is_refused_and_the_engine_still_connects(ray_session):
    import ray

    from tests.test_transport import _engine

    with _engine("ipc") as engine:
        actor = engine._executors[0].ranks.actor(0)
        address, token, _, rank_pid = ray.get(actor.open_ipc.remote(False, os.getpid()), timeout=30)
        assert rank_pid == engine.replica_status()[0].pids[0]
        with _intruder("connect", address[1:], token.hex()) as intruder:
            assert intruder.line() == "connected"  # in the listener's queue before the engine
            with peer.connect_rank(address, token, rank_pid, timeout_s=10) as sock:
                reply = _call(sock, "whoami")
                assert intruder.line() == "refused"
        assert (reply.status, reply.value["pid"]) == ("ok", rank_pid)
        assert engine.step({"sleep": 0}).tolist() == [3.0, 3.0]  # the engine's own lane is untouched

