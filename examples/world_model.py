"""A world model served on Ray: a tiny Wan pipeline folder, concurrent requests with progress bars, an MP4.

    PYTHONPATH=. .venv/bin/python examples/world_model.py [--requests 3] [--steps 8] [--out world_model.mp4]

1. Writes a tiny random `WanPipeline` folder (diffusers' and transformers' own classes, saved with
   `save_pretrained`, nothing downloaded; tests/diffusers_folders.py builds it). A real checkpoint
   folder (e.g. Wan2.1-T2V-1.3B-Diffusers) is served the same way with `--model /path/to/folder`.
2. Serves it with `plugin="diffusers_pipeline"` as one replica of Ray rank actors on this machine
   (`DeploymentConfig.local` starts a local Ray instance when none is running).
3. Streams `--requests` concurrent requests (different prompts, seeds and step counts; they are batched
   per denoising step). Each request has a progress bar fed by its stream's `{"step": i, "of": n}` items;
   where the stream carries no step reports, the bar jumps to n when the request finishes.
4. Writes the videos side by side into one MP4 (imageio with the ffmpeg binary imageio-ffmpeg ships).
   The weights are random, so the video is coloured noise that changes from frame to frame: it shows
   the shapes and the path, not a picture.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, WorkerSupervisorConfig

PLUGIN = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"  # also registered as "diffusers_pipeline"
PROMPTS = ("a robot arm picks up the red cube", "a dog runs left on the table", "camera moves right slowly",
           "a cat places the blue box in the bin")


def requests(count: int, steps: int, size: int, frames: int) -> list[dict[str, Any]]:
    """`count` requests: request i has prompt i, seed i and steps - i % 3 denoising steps (at least 1)."""
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "negative_prompt": "blurry", "height": size, "width": size,
             "num_frames": frames, "num_inference_steps": max(1, steps - i % 3), "guidance_scale": 5.0,
             "seed": i, "max_sequence_length": 16} for i in range(count)]


def stream_one(engine: Engine, request: dict[str, Any], bar: Any, timeout_s: float) -> tuple[dict, bool]:
    """Read one request's stream into `bar`; return (its result, whether the stream reported steps)."""
    stream, result, stepped = engine.stream(request, timeout=timeout_s), None, False
    while True:
        try:
            item = next(stream)
        except StopIteration as stop:
            result = stop.value if stop.value is not None else result
            break
        if isinstance(item, dict) and "step" in item and "of" in item:
            stepped = True
            bar.total = int(item["of"])
            bar.update(int(item["step"]) - bar.n)
        elif isinstance(item, dict) and "video" in item:
            result = item
    if not isinstance(result, dict) or "video" not in result:
        raise RuntimeError(f"the stream of {request['prompt']!r} ended without a video (got {type(result).__name__});"
                           " check the replica's log")
    bar.update(bar.total - bar.n)
    return result, stepped


def serve(folder: Path, batch: list[dict[str, Any]], timeout_s: float) -> tuple[list[np.ndarray], bool]:
    """Stream every request of `batch` at once against one Ray replica; the uint8 videos and whether
    the progress came from streamed steps."""
    from tqdm import tqdm

    args = EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder)},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    deployment = DeploymentConfig.local(cpus_per_rank=0.5,
                                        process_config=WorkerSupervisorConfig(execution_timeout_s=timeout_s))
    with Engine(args, deployment) as engine, ThreadPoolExecutor(len(batch)) as pool:
        bars = [tqdm(total=r["num_inference_steps"], desc=f"request {i} ({r['prompt'][:24]})", position=i,
                     unit="step") for i, r in enumerate(batch)]
        try:
            futures = [pool.submit(stream_one, engine, r, bar, timeout_s) for r, bar in zip(batch, bars)]
            done = [f.result(timeout=timeout_s + 60) for f in futures]
        finally:
            for bar in bars:
                bar.close()
    return [np.asarray(result["video"]) for result, _ in done], all(stepped for _, stepped in done)


def write_mp4(videos: list[np.ndarray], path: Path, fps: int) -> tuple[int, int, int]:
    """The videos ([frames, H, W, 3] uint8 each) side by side into one MP4 at `path`; its (frames, H, W)."""
    import imageio.v2 as imageio

    tiled = np.concatenate(videos, axis=2)
    with imageio.get_writer(path, fps=fps, codec="libx264", macro_block_size=1, quality=8) as writer:
        for frame in tiled:
            writer.append_data(frame)
    return tiled.shape[0], tiled.shape[1], tiled.shape[2]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a WanPipeline folder (default: build a tiny one)")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="the first request's steps (others: 1-2 fewer)")
    parser.add_argument("--size", type=int, default=64, help="height = width, a multiple of 16")
    parser.add_argument("--frames", type=int, default=17, help="4k+1")
    parser.add_argument("--fps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    parser.add_argument("--out", type=Path, default=Path("world_model.mp4"))
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = opts.model
        if folder is None:
            from tests.diffusers_folders import build_wan

            folder = build_wan(Path(tmp) / "tiny-wan21")
        start = time.perf_counter()
        videos, stepped = serve(folder, requests(opts.requests, opts.steps, opts.size, opts.frames), opts.timeout)
        seconds = time.perf_counter() - start
    shape = write_mp4(videos, opts.out, opts.fps)
    print(f"progress: {'streamed per denoising step' if stepped else 'per finished request (no step reports)'}")
    print(f"{len(videos)} videos of {tuple(videos[0].shape)} uint8 in {seconds:.1f}s -> {opts.out} "
          f"({shape[0]} frames of {shape[1]}x{shape[2]}, side by side)")
    return {"videos": videos, "stepped": stepped, "path": opts.out, "shape": shape}


if __name__ == "__main__":
    main()
