"""Shared-memory descriptors of the socket lane: closed on every exit path, bounded while queued,
and a descriptor limit reported as what it is.

Run: `.venv/bin/pytest tests/test_ipc_descriptors.py` (starts one local Ray instance for the session).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from concurrent.futures import wait

import pytest
import torch

from tests.test_transport import THREE, _engine

MIB_TENSOR = 2 ** 18  # float32 elements: 1 MiB, the smallest tensor that travels in a memfd


def _memfds() -> int:
    """Shared-memory files of the lane this process holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:phyai-")
        except OSError:
            pass
    return count


def _until(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.ray
def test_shared_memory_of_requests_no_rank_took_closes_when_the_replica_fails(ray_session):
    import ray

    with _engine("ipc", execution_timeout_s=60) as engine:
        engine.step({"sleep": 0})
        before = _memfds()
        futures = [engine.submit({"sleep": 0.5, "big": torch.ones(MIB_TENSOR)}) for _ in range(6)]
        assert _until(lambda: engine.replica_status()[0].dispatched == 2, 10)
        ray.kill(engine._executors[0].ranks.actor(1), no_restart=True)
        done, _ = wait(futures, timeout=10)
        assert len(done) == 6 and not engine.healthy
        assert _until(lambda: _memfds() == before, 5), f"{_memfds() - before} shared-memory file(s) left open"
        del futures, done


@pytest.mark.ray
def test_queued_large_tensors_hold_a_bounded_number_of_descriptors(ray_session):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with _engine("ipc", execution_timeout_s=120, max_queued_requests=1000) as engine:
        engine.step({"sleep": 0, "big": torch.ones(MIB_TENSOR)})
        opened = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (opened + 400, hard))
        try:
            first = engine.submit({"sleep": 0.5})  # holds the ranks while the rest queue
            futures = [engine.submit({"sleep": 0, "big": torch.full((MIB_TENSOR,), float(i))}) for i in range(600)]
            held = _memfds()
            assert all(torch.equal(f.result(timeout=120), THREE) for f in [first, *futures])
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert held <= (opened + 400) // 4 + 8, f"{held} descriptors held by queued requests"


_EXHAUST = """
import os, resource, torch
from actors import ipc_codec, ipc_wire
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
os.close(held.pop())  # one left: the memfd takes it, nothing is left for the body
try:
    ipc_wire.frame(b"", ipc_codec.encode({"big": torch.ones(2 ** 18), "body": bytes(300_000)}))
except Exception as exc:
    print(type(exc).__name__, isinstance(exc, OSError), exc)
"""


def test_running_out_of_descriptors_says_so():
    out = subprocess.run([sys.executable, "-c", _EXHAUST], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "True" in out.stdout and "too many open files" in out.stdout.lower(), out.stdout + out.stderr
    assert "ulimit -n" in out.stdout and "256" in out.stdout, out.stdout


def _thread_cpu_s(name_suffix: str) -> float:
    """CPU seconds (user + system) the live thread whose name ends in `name_suffix` has used."""
    import threading

    [thread] = [t for t in threading.enumerate() if t.name.endswith(name_suffix)]
    with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.ray
def test_the_lane_writer_waits_in_the_kernel_with_socket_descriptors_above_1024(ray_session):
    filler = []
    while not filler or filler[-1] < 1100:  # the lane's sockets get descriptors beyond select()'s range
        filler.append(os.open("/dev/null", os.O_RDONLY))
    try:
        with _engine("ipc", max_ongoing_requests=8) as engine:
            assert engine.step({"sleep": 0}) is not None
            spent = _thread_cpu_s("-ipc-writer")
            chunk = torch.ones(60_000)  # 240 KB bodies in the socket itself: 8 of them outgrow its buffer
            started = time.monotonic()
            futures = [engine.submit({"sleep": 0.2, "tag": i, "chunk": chunk}) for i in range(16)]
            assert all(torch.equal(f.result(timeout=60), THREE) for f in futures)
            waited, spent = time.monotonic() - started, _thread_cpu_s("-ipc-writer") - spent
            assert engine.collective_rpc("executed", replica=0) == [None] + list(range(16))
    finally:
        for fd in filler:
            os.close(fd)
    assert waited > 1.0 and spent < 0.25 * waited, f"the writer spent {spent:.2f} s of CPU in {waited:.2f} s"
