"""openpi's frames without a server: msgpack observations with NumPy arrays (pure unit tests, no Ray).

Run: .venv/bin/pytest tests/test_openpi_codec.py -q

Frames are built with msgpack in the layout openpi's `msgpack_numpy` writes
(`{b"__ndarray__": True, b"data", b"dtype", b"shape"}`); the real client is exercised against a
real server in tests/test_openpi.py.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from phyai_ray.serve.protocols.openpi import FrameError, pack, unpack


def array(a: np.ndarray, override: dict | None = None) -> dict:
    return {b"__ndarray__": True, b"data": a.tobytes(), b"dtype": a.dtype.str, b"shape": a.shape, **(override or {})}


def test_arrays_become_tensors_and_plain_values_pass_through() -> None:
    state = np.arange(6, dtype=np.float32).reshape(2, 3)
    frame = msgpack.packb({"state": array(state), "prompt": "pick", "step": 3,
                           "big_endian": array(np.arange(3, dtype=">i4"))})
    obs = unpack(frame, 1 << 20)
    assert obs["prompt"] == "pick" and obs["step"] == 3
    assert obs["state"].dtype == torch.float32 and obs["state"].tolist() == state.tolist()
    assert obs["big_endian"].tolist() == [0, 1, 2]  # converted to native order


@pytest.mark.parametrize("field, message", [
    ({b"dtype": "|O"}, "dtype |O is not supported"),
    ({b"dtype": "no-such"}, "unknown dtype|not understood"),
    ({b"shape": [2, 2]}, r"needs 16 bytes, got 12"),
    ({b"shape": [-1]}, "shape"),
    ({b"data": "text"}, "got str"),
])
def test_bad_arrays_are_refused_with_the_reason(field: dict, message: str) -> None:
    frame = msgpack.packb({"state": array(np.zeros(3, np.float32), field)})
    with pytest.raises(FrameError, match=message):
        unpack(frame, 1 << 20)


def test_the_byte_budget_and_garbage_frames() -> None:
    frame = msgpack.packb({"a": array(np.zeros(100, np.float32)), "b": array(np.zeros(100, np.float32))})
    assert set(unpack(frame, 800)) == {"a", "b"}
    with pytest.raises(FrameError, match="max-tensor-bytes"):
        unpack(frame, 799)
    with pytest.raises(FrameError, match="not a msgpack observation"):
        unpack(b"\xc1", 100)


def test_replies_pack_tensors_as_openpi_arrays() -> None:
    reply = msgpack.unpackb(pack({"actions": torch.ones(2, 3), "half": torch.ones(2, dtype=torch.bfloat16),
                                  "server_timing": {"infer_ms": 1.5}}))
    actions = reply["actions"]
    assert actions[b"__ndarray__"] and actions[b"dtype"] == "<f4" and actions[b"shape"] == [2, 3]
    assert np.frombuffer(actions[b"data"], dtype="<f4").tolist() == [1.0] * 6
    assert reply["half"][b"dtype"] == "<f4"  # bfloat16 has no NumPy dtype: sent as float32
    assert reply["server_timing"] == {"infer_ms": 1.5}
