"""LeRobot's side of benchmarks/bench_policy.py: a pi0-shaped policy written, loaded and timed in the reference venv.

Run by bench_policy.py (it starts this once and sends it commands); by hand:

    /tmp/lerobot-openpi-venv/bin/python scripts/lerobot_reference/bench_reference.py --out /tmp/bench-pi0 --threads 2

1. Writes a pi0 checkpoint under --out/pretrained_model as LeRobot's save_pretrained does (the
   sizes of SIZES and CONFIG below: pi0's shape, chunk 50, 10 denoising steps, 32-wide state and
   action, two cameras, a 48-token prompt; narrow enough for a CPU chunk of tens of ms), the tiny
   PaliGemma tokenizer under --out/backbone, and ROBOTS robots' frames (images, states, noise, prompts)
   under --out/frames.safetensors and --out/frames.json. make_reference.py's builders write it, with
   LeRobot's constructors patched to these sizes as there.
2. Loads the folder back with PI0Policy.from_pretrained and make_pre_post_processors(pretrained_path=...):
   what phyai-ray's `lerobot_policy` serves is what LeRobot loads.
3. Prints `BENCH_REF {"ready": ...}` and answers one JSON command per stdin line, each with one
   `BENCH_REF {...}` line (LeRobot's own prints go to stderr):

       {"cmd": "alone", "n": 8, "repeats": 3}   each of robots 0..n-1 in its own call, in turn: the
                                                 seconds of every call (preprocessor, predict_action_chunk,
                                                 postprocessor) and of predict_action_chunk alone
       {"cmd": "batch", "n": 8, "repeats": 3}   robots 0..n-1 as one batch: the seconds of each call
       {"cmd": "actions", "robot": 0}            that robot's chunk alone, for the parity check
       {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_reference as ref  # noqa: E402  (the builders of the tiny reference policies, beside this file)

ROBOTS = 16
STATE_DIM, ACTION_DIM = 14, 14  # a two-arm robot, as ALOHA's
IMAGE_CHW = (3, 96, 128)  # what the cameras send; resized with padding to CONFIG's image_resolution
SIZES = {  # pi0's layout (PaliGemma + a narrower Gemma expert of the same depth and heads), narrowed for a CPU
    "paligemma": {"width": 128, "depth": 2, "mlp_dim": 512, "num_heads": 4, "num_kv_heads": 1, "head_dim": 32},
    "action_expert": {"width": 64, "depth": 2, "mlp_dim": 256, "num_heads": 4, "num_kv_heads": 1, "head_dim": 32},
    "vision": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256,
               "patch_size": 16},
}
CONFIG = {"chunk_size": 50, "n_action_steps": 50, "num_inference_steps": 10, "max_state_dim": 32,
          "max_action_dim": 32, "image_resolution": (96, 96), "tokenizer_max_length": 48, "rtc_config": None}


def write(out: Path) -> dict:
    """The checkpoint, its tokenizer and the robots' frames under `out`; returns frames.json's content."""
    import lerobot.policies.pi0.configuration_pi0 as configuration
    from lerobot.policies.factory import make_pre_post_processors

    ref.PI_SIZES, ref.STATE_DIM, ref.ACTION_DIM, ref.IMAGE_CHW = SIZES, STATE_DIM, ACTION_DIM, IMAGE_CHW
    real = configuration.PI0Config
    configuration.PI0Config = lambda **kwargs: real(**{**kwargs, **CONFIG})  # pi_policy's config, pi0-shaped
    try:
        torch.manual_seed(ref.SEED)
        policy, vocab = ref.pi_policy("pi0", out / "backbone")
    finally:
        configuration.PI0Config = real
    gen = torch.Generator().manual_seed(ref.SEED)
    stats = {"observation.state": ref.stats(STATE_DIM, gen), "action": ref.stats(ACTION_DIM, gen)}
    pre, post = make_pre_post_processors(policy.config, dataset_stats=stats)
    folder = out / "pretrained_model"
    for part in (policy, pre, post):
        part.save_pretrained(folder)
    frames = ref.observations(gen, ROBOTS)
    tensors = {"state": torch.stack([f["observation.state"] for f in frames]),
               "noise": torch.randn(ROBOTS, CONFIG["chunk_size"], CONFIG["max_action_dim"], generator=gen)}
    for key in ref.CAMERAS:
        tensors[key] = torch.stack([f[key] for f in frames])
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "frames.safetensors"))
    meta = {"prompts": [f["task"] for f in frames], "cameras": list(ref.CAMERAS), "sizes": {**SIZES, "vocab_size": vocab},
            "parameters": sum(p.numel() for p in policy.parameters()), "lerobot": __import__("lerobot").__version__,
            "torch": torch.__version__}
    (out / "frames.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


class Reference:
    """The folder as LeRobot loads it, and the robots' frames."""

    def __init__(self, out: Path) -> None:
        from lerobot.policies.factory import make_pre_post_processors
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy

        folder = out / "pretrained_model"
        # strict=False: the file holds PaliGemma's tied embedding once, as lm_head (save_pretrained drops the
        # duplicate name); LeRobot loads it through the tie. bench_policy.py's parity check proves the load.
        self.policy = PI0Policy.from_pretrained(str(folder), strict=False).eval()
        self.pre, self.post = make_pre_post_processors(self.policy.config, pretrained_path=str(folder))
        self.t = load_file(str(out / "frames.safetensors"))
        self.prompts = json.loads((out / "frames.json").read_text())["prompts"]

    def batch(self, robots: list[int]) -> dict:
        out = {key: self.t[key][robots] for key in (*ref.CAMERAS, "state")}
        out["observation.state"] = out.pop("state")
        out["task"] = [self.prompts[r] for r in robots]
        return out

    def call(self, robots: list[int]) -> tuple[torch.Tensor, float, float]:
        """(actions, seconds of the whole call, seconds of predict_action_chunk) for these robots at once."""
        start = time.perf_counter()
        batch = self.pre(self.batch(robots))
        self.policy.reset()
        began = time.perf_counter()
        actions = self.policy.predict_action_chunk(batch, noise=self.t["noise"][robots])
        predicted = time.perf_counter() - began
        actions = self.post(actions)
        return actions, time.perf_counter() - start, predicted

    def answer(self, command: dict) -> dict:
        n, repeats = int(command.get("n", 1)), int(command.get("repeats", 1))
        if command["cmd"] == "alone":
            runs = [self.call([r])[1:] for _ in range(repeats) for r in range(n)]
            return {"seconds": [a for a, _ in runs], "predict_seconds": [b for _, b in runs]}
        if command["cmd"] == "batch":
            runs = [self.call(list(range(n)))[1:] for _ in range(repeats)]
            return {"seconds": [a for a, _ in runs], "predict_seconds": [b for _, b in runs]}
        if command["cmd"] == "actions":
            return {"actions": self.call([int(command["robot"])])[0][0].tolist()}
        raise ValueError(f"unknown command {command!r}; one of alone, batch, actions, quit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write the checkpoint and frames to")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    channel, sys.stdout = sys.stdout, sys.stderr  # LeRobot prints while loading: keep stdout for the protocol

    def say(obj: dict) -> None:
        channel.write("BENCH_REF " + json.dumps(obj) + "\n")
        channel.flush()

    meta = write(args.out)
    reference = Reference(args.out)
    with torch.inference_mode():
        reference.call([0])  # warm-up
    say({"ready": True, "threads": torch.get_num_threads(), **meta})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("cmd") == "quit":
            break
        with torch.inference_mode():
            say(reference.answer(command))


if __name__ == "__main__":
    main()
