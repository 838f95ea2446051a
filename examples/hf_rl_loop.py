"""An RL loop whose policy is a transformers model: rollouts on `hf_causal_lm`, weights synced by name.

Run:  .venv/bin/python examples/hf_rl_loop.py [--iterations 10]      (needs transformers: the test extra)
Job:  ray job submit --working-dir . -- python examples/hf_rl_loop.py

The example writes a tiny Llama checkpoint with transformers into a temporary folder; two rollout
replicas of `hf_causal_lm` load it behind an `EngineActor`, and a trainer actor loads the same
folder with `AutoModelForCausalLM`. Each iteration the replicas sample a group of completions per
prompt (one request per completion, each with its own seed, all in flight at once); a rule-based
reward (the fraction of tokens equal to TARGET) gives group-relative advantages; the trainer
recomputes the completions' log-probs with transformers' own forward (and checks they equal the
rollout's `log_probs`, so the importance ratio starts at 1), takes a policy-gradient step, and
pushes `model.named_parameters()` (transformers' names) to both replicas, version = iteration + 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from phyai_ray import DeploymentConfig, DeviceConfig, EngineActor, EngineArgs, EngineConfig, WeightSender  # noqa: E402

TARGET = 7
PROMPTS = [[1, 2, 3], [10, 11], [20, 21, 22, 23], [30]]
SHAPE = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, bos_token_id=0, eos_token_id=31)


def write_policy(folder: str) -> str:
    """A random Llama checkpoint (config.json + model.safetensors), as transformers saves it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.float32).save_pretrained(folder)
    return folder


def reward(completion: list[int]) -> float:
    return sum(t == TARGET for t in completion) / len(completion)


@ray.remote(num_cpus=0)
class Trainer:
    """Owns the transformers policy and its optimizer; recomputes log-probs with the model's own forward."""

    def __init__(self, folder: str, lr: float) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.sender = WeightSender("object_store")

    def connect(self, rollout: Any) -> None:
        self.sender.init_transfer(rollout)

    def log_probs(self, prompt: list[int], completion: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].float()
        return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)

    def train_and_push(self, samples: list[tuple[list[int], list[int], list[float], float]], rollout: Any,
                       version: int) -> dict:
        loss, gap = torch.zeros(()), 0.0
        for prompt, completion, rollout_lp, advantage in samples:
            lp = self.log_probs(prompt, completion)
            gap = max(gap, float((lp.detach() - torch.tensor(rollout_lp)).abs().max()))
            loss = loss - advantage * lp.sum()
        self.opt.zero_grad()
        (loss / len(samples)).backward()
        self.opt.step()
        reports = self.sender.update(rollout, self.model.named_parameters(), version)
        return {"loss": float(loss.detach()) / len(samples), "gap": gap, "states": [r.state for r in reports],
                "errors": [r.error for r in reports]}


def rollout_batch(rollout: Any, iteration: int, group: int, max_tokens: int) -> tuple[list, float]:
    prompts = [p for p in PROMPTS for _ in range(group)]
    requests = [{"prompts": [p], "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
                 "seed": iteration * len(prompts) + i} for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = ray.get([rollout.submit.remote(r) for r in requests], timeout=120)
    seconds = time.perf_counter() - start
    return [(r["prompts"][0], result.value[0], result.weight_version) for r, result in zip(requests, results)], seconds


def advantages(rows: list, group: int) -> list[tuple[list[int], list[int], list[float], float]]:
    samples = []
    for start in range(0, len(rows), group):
        chunk = rows[start:start + group]
        rewards = [reward(out.token_ids) for _, out, _ in chunk]
        mean, std = statistics.mean(rewards), statistics.pstdev(rewards)
        samples += [(p, out.token_ids, out.log_probs, (r - mean) / (std + 1e-6))
                    for (p, out, _), r in zip(chunk, rewards)]
    return samples


def main(iterations: int = 10, group: int = 8, max_tokens: int = 8, lr: float = 0.05) -> list[float]:
    if not ray.is_initialized():  # under `ray job submit` RAY_ADDRESS names the cluster: join it as it is
        ray.init(**({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(4, os.cpu_count() or 1),
                                                              "include_dashboard": False}))
    folder = write_policy(tempfile.mkdtemp(prefix="hf-rl-policy-"))
    args = EngineArgs(plugin="hf_causal_lm", plugin_args={"model": folder},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    rollout = EngineActor.options(num_cpus=0).remote(args, DeploymentConfig(mode="local", replica_count=2,
                                                                            cpus_per_rank=0.5))
    trainer = Trainer.remote(folder, lr)
    curve: list[float] = []
    try:
        ray.get(trainer.connect.remote(rollout), timeout=120)
        version = None
        for it in range(iterations):
            rows, seconds = rollout_batch(rollout, it, group, max_tokens)
            stale = [v for _, _, v in rows if v != version]
            if stale:
                raise RuntimeError(f"iteration {it}: rollouts carry weight versions {set(stale)}, expected {version}")
            curve.append(statistics.mean(reward(out.token_ids) for _, out, _ in rows))
            rate = sum(len(out.token_ids) for _, out, _ in rows) / seconds
            version = it + 1
            info = ray.get(trainer.train_and_push.remote(advantages(rows, group), rollout, version), timeout=120)
            if any(info["errors"]):
                raise RuntimeError(f"weight sync failed: {info['errors']}")
            if info["gap"] > 1e-4:
                raise RuntimeError(f"iteration {it}: the trainer's log-probs differ from the rollout's by "
                                   f"{info['gap']}")
            print(f"iteration {it:2d}: mean reward {curve[-1]:.3f}  loss {info['loss']:+.3f}  rollout {rate:5.0f} "
                  f"tok/s  |trainer - rollout log-prob| <= {info['gap']:.1e}  pushed version {version}", flush=True)
    finally:
        ray.get(rollout.close.remote(), timeout=60)
        ray.kill(rollout)
        ray.kill(trainer)
    print(f"reward: first {curve[0]:.3f} -> last {curve[-1]:.3f}")
    return curve


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    opts = parser.parse_args()
    try:
        curve = main(opts.iterations, lr=opts.lr)
    finally:
        ray.shutdown()
    print(f"hf_rl_loop: {len(curve)} iterations, reward {curve[0]:.3f} -> {curve[-1]:.3f}")
