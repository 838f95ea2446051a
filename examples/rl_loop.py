"""A GRPO-style RL loop on CPU: a trainer actor, two rollout replicas behind an `EngineActor`.

Run:  .venv/bin/python examples/rl_loop.py [--iterations 12]
Job:  ray job submit --working-dir . -- python examples/rl_loop.py

Each iteration the rollout replicas (`reference_lm`, seeded weights) sample a group of
completions per prompt; a rule-based reward scores each completion (the fraction of its tokens
equal to TARGET); the trainer turns rewards into group-relative advantages, takes one
policy-gradient step on its own copy of the weights (log-probs from `reference_lm.score`, the
same math the rollout uses), and pushes the new weights to both replicas in the four phases
with version = iteration + 1. Every rollout must carry the version just pushed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from phyai_ray import DeploymentConfig, DeviceConfig, EngineActor, EngineArgs, EngineConfig, WeightSender  # noqa: E402

TARGET = 7  # the token the reward asks for
PROMPTS = [[1, 2, 3], [10, 11], [20, 21, 22, 23], [30]]
PLUGIN_ARGS = {"seed": 0, "dim": 32, "heads": 2, "layers": 1, "vocab": 32, "max_seq": 32}


def reward(completion: list[int]) -> float:
    return sum(t == TARGET for t in completion) / len(completion)


@ray.remote(num_cpus=0)
class Trainer:
    """Owns the policy's weights (the same model `reference_lm` serves) and its optimizer."""

    def __init__(self, lr: float) -> None:
        from phyai_ray.models.reference_lm import ReferenceLMConfig, full_weights

        torch.manual_seed(0)
        self.cfg = ReferenceLMConfig(**PLUGIN_ARGS)
        self.weights = {k: torch.nn.Parameter(v.clone()) for k, v in full_weights(self.cfg).items()}
        self.opt = torch.optim.Adam(self.weights.values(), lr=lr)
        self.sender = WeightSender("object_store")

    def connect(self, rollout: Any) -> None:
        self.sender.init_transfer(rollout)

    def train_and_push(self, samples: list[tuple[list[int], list[int], float]], rollout: Any, version: int) -> dict:
        """One policy-gradient step on group-relative advantages, then the four-phase weight sync."""
        from phyai_ray.models.reference_lm import score

        loss = torch.zeros(())
        for prompt, completion, advantage in samples:
            loss = loss - advantage * score(self.weights, prompt, completion, self.cfg).sum()
        self.opt.zero_grad()
        (loss / len(samples)).backward()
        self.opt.step()
        reports = self.sender.update(rollout, [(k, v.detach()) for k, v in self.weights.items()], version)
        return {"loss": float(loss.detach()) / len(samples), "states": [r.state for r in reports],
                "errors": [r.error for r in reports]}


def rollout_batch(rollout: Any, iteration: int, group: int, max_tokens: int) -> list:
    """`group` sampled completions per prompt, split over the two replicas (one request each)."""
    prompts = [p for p in PROMPTS for _ in range(group)]
    half = len(prompts) // 2
    requests = [{"prompts": part, "max_tokens": max_tokens, "temperature": 1.0, "seed": 2 * iteration + k}
                for k, part in enumerate((prompts[:half], prompts[half:]))]
    results = ray.get([rollout.submit.remote(r) for r in requests], timeout=120)
    return [(p, out, result.weight_version) for r, result in zip(requests, results)
            for p, out in zip(r["prompts"], result.value)]


def advantages(rows: list, group: int) -> list[tuple[list[int], list[int], float]]:
    samples = []
    for start in range(0, len(rows), group):
        chunk = rows[start:start + group]
        rewards = [reward(out.token_ids) for _, out, _ in chunk]
        mean, std = statistics.mean(rewards), statistics.pstdev(rewards)
        samples += [(p, out.token_ids, (r - mean) / (std + 1e-6)) for (p, out, _), r in zip(chunk, rewards)]
    return samples


def main(iterations: int = 12, group: int = 8, max_tokens: int = 8, lr: float = 0.05) -> list[float]:
    if not ray.is_initialized():  # under `ray job submit` RAY_ADDRESS names the cluster: join it as it is
        ray.init(**({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(4, os.cpu_count() or 1),
                                                              "include_dashboard": False}))
    args = EngineArgs(plugin="reference_lm", plugin_args=PLUGIN_ARGS, config=EngineConfig(device=DeviceConfig(target="cpu")))
    rollout = EngineActor.options(num_cpus=0).remote(args, DeploymentConfig(mode="local", replica_count=2,
                                                                            cpus_per_rank=0.5))
    trainer = Trainer.remote(lr)
    curve = []
    try:
        ray.get(trainer.connect.remote(rollout), timeout=120)
        version = None
        for it in range(iterations):
            rows = rollout_batch(rollout, it, group, max_tokens)
            versions = {v for _, _, v in rows} | {out.weight_version for _, out, _ in rows}
            if versions != {version}:
                raise RuntimeError(f"iteration {it}: rollouts carry weight versions {versions}, expected {version}")
            mean_reward = statistics.mean(reward(out.token_ids) for _, out, _ in rows)
            curve.append(mean_reward)
            version = it + 1
            info = ray.get(trainer.train_and_push.remote(advantages(rows, group), rollout, version), timeout=120)
            if any(info["errors"]):
                raise RuntimeError(f"weight sync failed: {info['errors']}")
            print(f"iteration {it:2d}: mean reward {mean_reward:.3f}  loss {info['loss']:+.3f}  "
                  f"pushed version {version} to {info['states']}", flush=True)
    finally:
        ray.get(rollout.close.remote(), timeout=60)
        ray.kill(rollout)
        ray.kill(trainer)
    print(f"reward: first {curve[0]:.3f} -> last {curve[-1]:.3f}")
    return curve


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    opts = parser.parse_args()
    curve = main(opts.iterations, opts.group, lr=opts.lr)
    print(f"rl_loop: {len(curve)} iterations, reward {curve[0]:.3f} -> {curve[-1]:.3f}")
