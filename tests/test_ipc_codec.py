"""The socket lane's encoding and framing (`actors.ipc_codec`, `actors.ipc_wire`), without Ray: round trips, shared memory, descriptors.

Run: `.venv/bin/pytest tests/test_ipc_codec.py`.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from actors import ipc_codec, ipc_wire

pytestmark = pytest.mark.skipif(not ipc_codec.SUPPORTED, reason="the socket lane needs Linux (memfd)")


def _round_trip(obj, private=True):
    encoded = ipc_codec.encode(obj)
    fds = [os.dup(fd) for fd in encoded.fds]  # what a receiver holds after SCM_RIGHTS
    encoded.close()
    count = len(fds)
    return ipc_codec.decode(encoded.body, fds, private=private), count


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("tensor", [
    torch.arange(16.0), torch.arange(12).view(3, 4).t(), torch.zeros(0, 3), torch.tensor(2.5, dtype=torch.bfloat16),
    torch.tensor([True, False]), torch.arange(6, dtype=torch.int64).view(2, 3), torch.ones(3, requires_grad=True),
    torch.arange(2 ** 19, dtype=torch.float64).view(512, 1024)[:, ::2],  # 2 MB strided view: shared memory
])
def test_tensors_round_trip_with_dtype_shape_values_and_grad_flag(tensor):
    out, sent_fds = _round_trip({"t": tensor, "n": 3})
    got = out["t"]
    assert (got.dtype, got.shape, got.requires_grad) == (tensor.dtype, tensor.shape, tensor.requires_grad)
    assert torch.equal(got.detach(), tensor.detach()) and out["n"] == 3
    assert sent_fds == (1 if tensor.numel() * tensor.element_size() >= ipc_codec.LARGE_TENSOR_BYTES else 0)


def test_large_tensors_travel_in_shared_memory_not_in_the_message():
    big = torch.ones(2 ** 20)  # 4 MB
    encoded = ipc_codec.encode([big, big * 2])
    assert len(encoded.body) < 1000 and len(encoded.fds) == 2
    encoded.close()


def test_a_private_mapping_is_copy_on_write_and_a_shared_one_is_the_senders_pages():
    encoded = ipc_codec.encode(torch.zeros(2 ** 18))  # 1 MB: one memfd
    fd = encoded.fds[0]
    first = ipc_codec.decode(encoded.body, [os.dup(fd)], private=True)
    second = ipc_codec.decode(encoded.body, [os.dup(fd)], private=True)
    first.add_(1)
    assert float(second.sum()) == 0.0 and float(first.sum()) == 2 ** 18  # each rank writes its own view
    shared_a = ipc_codec.decode(encoded.body, [os.dup(fd)], private=False)
    shared_b = ipc_codec.decode(encoded.body, [os.dup(fd)], private=False)
    shared_a[0] = 7
    assert float(shared_b[0]) == 7.0
    encoded.close()


def test_closures_fall_back_to_cloudpickle_and_unpicklable_values_raise_without_leaking_descriptors():
    scale = 3
    out, _ = _round_trip({"f": lambda x: x * scale, "big": torch.ones(2 ** 18)})
    assert out["f"](2) == 6 and float(out["big"].sum()) == 2 ** 18
    before = _open_fds()
    with pytest.raises(TypeError, match="lock"):
        ipc_codec.encode({"big": torch.ones(2 ** 18), "lock": threading.Lock()})
    assert _open_fds() == before


def test_frames_carry_descriptors_and_large_bodies_over_a_socket_pair():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    payloads = [{"x": torch.arange(10.0)}, torch.ones(2 ** 20), [b"x" * (ipc_codec.BODY_IN_MEMFD_BYTES + 10)]]
    try:
        before = _open_fds()
        for payload in payloads:
            sender = threading.Thread(target=ipc_wire.send_encoded, args=(left, b"meta", ipc_codec.encode(payload)))
            sender.start()
            meta, body, got_fds = ipc_wire.recv_frame(right)
            sender.join(timeout=10)
            out = ipc_codec.decode(body, got_fds, private=False)
            assert meta == b"meta"
            if isinstance(payload, torch.Tensor):
                assert torch.equal(out, payload)
            elif isinstance(payload, dict):
                assert torch.equal(out["x"], payload["x"])
            else:
                assert out == payload
            del out, body
        assert _open_fds() == before
        left.close()
        assert ipc_wire.recv_frame(right) is None  # a clean end of the stream
    finally:
        left.close()
        right.close()


def test_a_stream_cut_in_the_middle_of_a_message_is_an_error_not_a_hang():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    data, fds = ipc_wire.frame(b"", ipc_codec.encode({"x": list(range(1000))}))
    left.sendall(data[: len(data) // 2])
    left.close()
    with pytest.raises(ConnectionError, match="closed in the middle"):
        ipc_wire.recv_frame(right)
    right.close()

