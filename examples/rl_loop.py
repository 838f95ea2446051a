"""A GRPO-style RL loop on CPU: a trainer actor, two rollout replicas behind an `EngineActor`.

Run:  .venv/bin/python examples/rl_loop.py [--iterations 12]
Job:  ray job submit --working-dir . -- python examples/rl_loop.py

Each iteration the rollout replicas (`reference_lm`, seeded weights) sample a group of
completions per prompt, one request per completion (as verl's agent loop sends them: every
request one prompt with its own seed, all in flight at once, batched by the replicas); a
rule-based reward scores each completion (the fraction of its tokens equal to TARGET); the
trainer turns rewards into group-relative advantages, takes one policy-gradient step on its own
copy of the weights (log-probs from `reference_lm.score`, the same math the rollout uses), and
pushes the new weights to both replicas in the four phases with version = iteration + 1. Every
rollout, and every token of it, must carry the version just pushed. Each line reports the
rollout's tokens/s (tokens generated / wall time of the rollout).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
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


def rollout_batch(rollout: Any, iteration: int, group: int, max_tokens: int) -> tuple[list, float]:
    """`group` sampled completions per prompt, ONE request per completion, each with its own seed,
    all submitted at once (the engine spreads them over the replicas): (rows, seconds)."""
    prompts = [p for p in PROMPTS for _ in range(group)]
    requests = [{"prompts": [p], "max_tokens": max_tokens, "temperature": 1.0, "seed": iteration * len(prompts) + i}
                for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = ray.get([rollout.submit.remote(r) for r in requests], timeout=120)
    seconds = time.perf_counter() - start
    return [(r["prompts"][0], result.value[0], result.weight_version) for r, result in zip(requests, results)], seconds


def check_versions(rows: list, version: Any, iteration: int) -> None:
    """Every result, its output and each of its tokens (when the plugin reports them) carry `version`."""
    for prompt, out, result_version in rows:
        per_token = set(out.weight_versions)
        if result_version != version or out.weight_version != version or not per_token <= {version}:
            raise RuntimeError(f"iteration {iteration}: a rollout of prompt {prompt} carries weight version "
                               f"{result_version} (output {out.weight_version}, per token "
                               f"{sorted(per_token, key=str)}), expected {version}")


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
    curve: list[float] = []
    rates: list[float] = []
    try:
        ray.get(trainer.connect.remote(rollout), timeout=120)
        version = None
        for it in range(iterations):
            rows, seconds = rollout_batch(rollout, it, group, max_tokens)
            check_versions(rows, version, it)
            mean_reward = statistics.mean(reward(out.token_ids) for _, out, _ in rows)
            curve.append(mean_reward)
            rates.append(sum(len(out.token_ids) for _, out, _ in rows) / seconds)
            version = it + 1
            info = ray.get(trainer.train_and_push.remote(advantages(rows, group), rollout, version), timeout=120)
            if any(info["errors"]):
                raise RuntimeError(f"weight sync failed: {info['errors']}")
            print(f"iteration {it:2d}: mean reward {mean_reward:.3f}  loss {info['loss']:+.3f}  "
                  f"rollout {len(rows)} requests {rates[-1]:6.0f} tok/s  pushed version {version} to {info['states']}",
                  flush=True)
    finally:
        ray.get(rollout.close.remote(), timeout=60)
        ray.kill(rollout)
        ray.kill(trainer)
    print(f"reward: first {curve[0]:.3f} -> last {curve[-1]:.3f}; mean rollout {statistics.mean(rates):.0f} tok/s "
          f"({len(PROMPTS) * group} one-prompt requests of {max_tokens} tokens per iteration)")
    return curve


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    opts = parser.parse_args()
    try:
        curve = main(opts.iterations, opts.group, lr=opts.lr)
    finally:
        ray.shutdown()
    print(f"rl_loop: {len(curve)} iterations, reward {curve[0]:.3f} -> {curve[-1]:.3f}")
