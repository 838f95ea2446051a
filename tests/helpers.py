"""Helpers shared by the serving, CLI and job tests: ports, deadlines, processes, HTTP steps.

Every wait here has a deadline and says what it waited for when it runs out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Runs argv[1:] with SIGINT back at its default. A process started from a background job of a
# non-interactive shell (`make test &`, CI runners, nohup ... &) inherits SIGINT *ignored*, exec
# keeps it ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C (SIGINT) does
# nothing to a child such as `serve run`. Resetting it to SIG_DFL before exec lets the child's
# Python install its own handler again.
_SIGINT_DEFAULT_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                        "os.execv(sys.argv[1], sys.argv[1:])")


def console_script(name: str) -> str:
    """The path of this venv's console script `name` (installed by `pip install -e .`)."""
    path = BIN / name
    assert path.exists(), f"the {name} console script is not installed in this venv (pip install -e .)"
    return str(path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.25) -> Any:
    """The first truthy value of `check()` within `timeout_s`; else AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def start_interruptible(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv)` in its own session, with SIGINT handled by default in the child."""
    return subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT_EXEC, *argv], start_new_session=True,
                            **popen_kwargs)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_leftovers(proc: subprocess.Popen, started: set[int]) -> None:
    """SIGKILL `proc` (if running) and every process of `started` or below it that is still alive."""
    pids = started | descendants(proc.pid)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    for pid in pids | {p for q in pids for p in descendants(q)}:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop_and_check(proc: subprocess.Popen, started: set[int], sig: int = signal.SIGTERM,
                   timeout_s: float = 90) -> None:
    """Send `sig`: the process exits 0 within `timeout_s`, and all it started is gone within 30 s."""
    started |= descendants(proc.pid)
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"pid {proc.pid} did not exit within {timeout_s}s of {signal.Signals(sig).name}") from None
    assert code == 0, f"exit status {code} after {signal.Signals(sig).name}"
    wait_until(lambda: not [p for p in started if alive(p)], 30, f"the processes {sorted(started)} to exit")


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log: Path | None = None) -> None:
    """Until `GET url/readyz` answers 200; fails at once if `proc` exits first."""
    import requests

    def ready() -> bool:
        if proc.poll() is not None:
            tail = log.read_text()[-4000:] if log is not None else ""
            raise AssertionError(f"the server exited early ({proc.returncode}):\n{tail}")
        try:
            return requests.get(f"{url}/readyz", timeout=2).status_code == 200
        except requests.RequestException:  # not listening yet, or the proxy waits for the replica
            return False

    wait_until(ready, timeout_s, f"{url}/readyz to answer 200", interval_s=0.5)


def wait_for_log(log: Path, text: str, timeout_s: float) -> None:
    """Until `text` appears in the file `log`."""
    wait_until(lambda: text in log.read_text(), timeout_s, f"{text!r} in {log}", interval_s=0.2)


def post_step(url: str, payload: Any, key: str | None = None, timeout_s: float = 60, **extra: Any) -> Any:
    """`POST url/v1/step` with `payload` (tensors are encoded) and the bearer `key`; the response."""
    import requests

    from phyai_ray.serve.protocols import codec

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{url}/v1/step", json={**codec.encode(payload), **extra}, headers=headers,
                         timeout=timeout_s)


def asgi_request(app: Any, method: str, path: str, json_body: Any = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """One HTTP request straight into an ASGI app, no server or socket: (status, headers, JSON body)."""
    import asyncio
    import json

    body = b"" if json_body is None else json.dumps(json_body).encode()
    sent_headers = {k.lower(): v for k, v in (headers or {}).items()}
    if body:
        sent_headers.setdefault("content-type", "application/json")
        sent_headers["content-length"] = str(len(body))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in sent_headers.items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=60))
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    reply_headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start.get("headers", [])}
    return start["status"], reply_headers, json.loads(data) if data else None
