"""Smoke run of examples/world_model.py (its `main()`) on CPU, against the session's Ray.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_world_model_example.py -q

Two small requests (32x32, 5 frames, 3 and 2 steps) through a Ray replica of a tiny Wan folder;
the MP4 it writes is read back with imageio: the frame count and the side-by-side size must match
the requests, and the first frame must equal the first request's video (up to the codec's loss).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ray
pytest.importorskip("diffusers")
imageio = pytest.importorskip("imageio.v2")


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_world_model_example_streams_requests_and_writes_an_mp4(ray_session, tmp_path, capsys):
    out = tmp_path / "world.mp4"
    summary = _load("examples/world_model.py").main(["--requests", "2", "--steps", "3", "--size", "32",
                                                      "--frames", "5", "--timeout", "120", "--out", str(out)])
    assert [v.shape for v in summary["videos"]] == [(5, 32, 32, 3)] * 2
    assert all(v.dtype == np.uint8 and v.std() > 0 for v in summary["videos"])
    assert summary["shape"] == (5, 32, 64)
    frames = np.stack(list(imageio.get_reader(out, "ffmpeg").iter_data()))
    assert frames.shape == (5, 32, 64, 3)
    mean_error = np.abs(frames[0, :, :32].astype(float) - summary["videos"][0][0].astype(float)).mean()
    assert mean_error < 40, mean_error  # lossy H.264 of noise; a wrong tile or frame differs by ~85
    text = capsys.readouterr().out
    assert "progress: " in text and str(out) in text
