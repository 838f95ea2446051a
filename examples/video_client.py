"""Generate a video through OpenAI's Videos API with the `openai` client: create, a progress bar, the MP4.

    phyai-ray serve diffusers_pipeline --plugin-args '{"model": "/models/Wan2.1-T2V-1.3B-Diffusers"}'
    python examples/video_client.py --prompt "a robot arm stacks three cubes" --size 832x480 --seconds 5

Any server of OpenAI's Videos API works (`--base-url`); the extra fields (`--steps`, `--seed`) are this
server's plugin fields (docs/serving/videos.md).
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    import openai
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("PHYAI_RAY_API_KEY", "none"))
    parser.add_argument("--prompt", default="a robot arm picks up the red cube")
    parser.add_argument("--size", default="832x480", help="WIDTHxHEIGHT")
    parser.add_argument("--seconds", default="2")
    parser.add_argument("--steps", type=int, default=None,
                        help="num_inference_steps (the model's default if not given)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="video.mp4")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="give up (and delete the job) after this long")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    extra = {"seed": args.seed, **({"num_inference_steps": args.steps} if args.steps else {})}
    video = client.videos.create(prompt=args.prompt, size=args.size, seconds=args.seconds, extra_body=extra)
    began = time.monotonic()
    with tqdm(total=100, desc=video.id, unit="%") as bar:
        while video.status in ("queued", "in_progress"):
            if time.monotonic() - began > args.timeout_s:
                client.videos.delete(video.id)
                raise SystemExit(f"{video.id} did not finish within {args.timeout_s} s; deleted it")
            time.sleep(0.5)
            video = client.videos.retrieve(video.id)
            bar.update(video.progress - bar.n)
    if video.status != "completed":
        raise SystemExit(f"{video.id} failed: {video.error.code}: {video.error.message}")
    client.videos.download_content(video.id).write_to_file(args.out)
    print(f"{args.out}: {video.size}, {video.seconds} s, in {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()
