"""A local process that tries to take over a rank's request socket (tests of `actors.peer`).

    python ipc_intruder.py connect NAME TOKEN_HEX   connect to abstract socket NAME first and send the
                                                    token; prints "connected", then "refused" when the
                                                    rank closes it, or "accepted" when it keeps it
    python ipc_intruder.py listen NAME              bind abstract NAME as the rank would; prints
                                                    "listening", then "received N" (bytes the engine sent)
"""

from __future__ import annotations

import socket
import sys

WAIT_S = 20.0


def _connect(name: str, token: bytes) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name)
    print("connected", flush=True)  # queued at the listener; the rank may refuse it before the token is written
    sock.settimeout(WAIT_S)
    try:
        sock.sendall(token)
        closed = sock.recv(1) == b""
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    except socket.timeout:
        closed = False
    print("refused" if closed else "accepted", flush=True)


def _listen(name: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    sock.listen(1)
    print("listening", flush=True)
    sock.settimeout(WAIT_S)
    conn, _ = sock.accept()
    conn.settimeout(2.0)
    received = b""
    try:
        while chunk := conn.recv(4096):
            received += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    print(f"received {len(received)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "connect":
        _connect(sys.argv[2], bytes.fromhex(sys.argv[3]))
    else:
        _listen(sys.argv[2])
