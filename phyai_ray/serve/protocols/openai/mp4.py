"""A served video as the files OpenAI's Videos API hands out: an H.264 MP4 and a PNG thumbnail.

    data = mp4_bytes(frames, fps=16)     # uint8 [frames, H, W, 3] -> H.264, yuv420p, CRF 12 (see below)
    png = thumbnail_png(frames)           # the first frame as a PNG
    back = mp4_frames(data)               # uint8 [frames, H, W, 3] decoded again (tests, the example)
    psnr_luma(frames, back)               # the codec's loss, in dB, as x264 reports it (on luma)

The encoder is the ffmpeg binary that `imageio-ffmpeg` ships in its wheel: no system ffmpeg is needed.
The settings: libx264, pixel format yuv420p (what every browser and player decodes), constant rate
factor `crf` (default 12: near-lossless; 18 is x264's "visually lossless", 23 its default), preset
"medium", `+faststart` (the index up front, so a player starts before the download ends). yuv420p
keeps one chroma sample per 2 x 2 pixels: an odd width or height is padded by one black column or row
(and cropped again by `mp4_frames` when given the size).

The loss at these settings (tests/test_openai_videos.py): luma PSNR >= 30 dB (41 dB on the tiny test
model's noise-like frames at CRF 12). The RGB PSNR of such frames is lower (about 23 dB) because 4:2:0
chroma keeps one colour sample per 2 x 2 pixels; natural video, whose colour varies smoothly, loses
far less to it.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

import numpy as np

DEFAULT_CRF = 12


class VideoEncodingError(RuntimeError):
    """The frames could not be written as an MP4 (the message says what they were)."""


def as_frames(video: Any) -> np.ndarray:
    """A plugin's video (a torch tensor or an array, uint8 [frames, H, W, 3]) as a contiguous numpy array."""
    frames = video.numpy() if hasattr(video, "numpy") else np.asarray(video)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise VideoEncodingError(f"a video must be uint8 [frames, H, W, 3]; got {frames.dtype} {list(frames.shape)}")
    return np.ascontiguousarray(frames)


def _even(frames: np.ndarray) -> np.ndarray:
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)))
    return frames


def mp4_bytes(video: Any, fps: float = 16.0, crf: int = DEFAULT_CRF) -> bytes:
    """H.264 / yuv420p MP4 of uint8 frames [frames, H, W, 3] at `fps` frames per second."""
    import imageio_ffmpeg

    frames = _even(as_frames(video))
    if not frames.shape[0]:
        raise VideoEncodingError("a video needs at least one frame to be written as an MP4")
    height, width = frames.shape[1:3]
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(
            path, (width, height), fps=fps, codec="libx264", pix_fmt_in="rgb24", pix_fmt_out="yuv420p",
            quality=None, macro_block_size=1, ffmpeg_log_level="error",
            output_params=["-crf", str(int(crf)), "-preset", "medium", "-movflags", "+faststart"])
        writer.send(None)  # starts ffmpeg
        for frame in frames:
            writer.send(frame)
        writer.close()
        with open(path, "rb") as f:
            return f.read()
    except (OSError, RuntimeError) as exc:
        raise VideoEncodingError(f"ffmpeg could not encode {frames.shape[0]} frames of {width}x{height} "
                                 f"at {fps} fps: {exc}") from exc
    finally:
        os.unlink(path)


def mp4_frames(data: bytes, size: tuple[int, int] | None = None) -> np.ndarray:
    """The uint8 frames [frames, H, W, 3] of an MP4; `size` (width, height) crops an odd size's padding."""
    import imageio_ffmpeg

    fd, path = tempfile.mkstemp(suffix=".mp4")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        reader = imageio_ffmpeg.read_frames(path)
        meta = next(reader)
        width, height = meta["size"]
        frames = [np.frombuffer(chunk, np.uint8).reshape(height, width, 3) for chunk in reader]
    finally:
        os.unlink(path)
    out = np.stack(frames)
    return out if size is None else out[:, :size[1], :size[0]]


def thumbnail_png(video: Any) -> bytes:
    """The first frame as PNG bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(as_frames(video)[0]).save(buffer, format="PNG")
    return buffer.getvalue()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 videos of one shape, in dB (inf when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)


def psnr_luma(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR of the luma (BT.601 weights) of two uint8 RGB videos of one shape, in dB: the measure a
    video codec's loss is quoted in (chroma subsampling is a format choice, not a coding loss)."""
    weights = np.array([0.299, 0.587, 0.114])
    ya, yb = a.astype(np.float64) @ weights, b.astype(np.float64) @ weights
    mse = float(np.mean((ya - yb) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)
