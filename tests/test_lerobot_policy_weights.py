"""`lerobot_policy` on a Ray rank actor: weight updates by the checkpoint's own names, and the weight
version of every chunk.

Run: `flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_lerobot_policy_weights.py -q`

The tiny SmolVLA of tests/data/lerobot/ is served by one rank actor. An update with an unknown name
or a wrong shape is refused before any tensor changes (the chunks stay the old ones, the version
too); an update under model.safetensors' names is followed: the chunks then equal those of an inline
engine serving a copy of the folder holding the new tensors, and each chunk carries the version of
the weights that computed it (a value sequence's version, recorded by the iteration loop).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from phyai_ray import DeploymentConfig, Engine, EngineArgs, EngineConfig, WeightSender, WeightUpdateRefusedError
from phyai_ray.config.engine import DeviceConfig
from tests.test_lerobot_policy import DATA, Cases, args_of
from tests.tolerances import against

pytestmark = pytest.mark.ray
PLUGIN = "phyai_ray.models.lerobot_policy:LeRobotPolicyEntry"
CPU = EngineConfig(device=DeviceConfig(target="cpu"))
CHANGED = ("model.action_out_proj.weight", "model.action_out_proj.bias", "model.state_proj.weight")


def trained() -> dict[str, torch.Tensor]:
    """model.safetensors' tensors, three of them moved as a trainer's step would."""
    weights = load_file(str(DATA / "smolvla" / "pretrained_model" / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    for name in CHANGED:
        weights[name] = weights[name] + 0.3 * torch.randn(weights[name].shape, generator=gen)
    return weights


def chunks(engine: Engine, cases: Cases) -> tuple[list[torch.Tensor], list]:
    """Every reference frame submitted together: their chunks and the weight version of each."""
    futures = [engine.submit(cases.frame(i)) for i in range(cases.n)]
    results = [f.result(timeout=120)["actions"] for f in futures]
    return results, [f.weight_version for f in futures]


def test_an_update_by_checkpoint_names_is_checked_first_then_followed(ray_session, tmp_path: Path) -> None:
    cases, weights = Cases("smolvla"), trained()
    engine = Engine(EngineArgs(plugin=PLUGIN, plugin_args=args_of("smolvla"), config=CPU),
                    DeploymentConfig(mode="local", replica_count=1, cpus_per_rank=0.5))
    try:
        before, versions = chunks(engine, cases)
        for got, want in zip(before, cases.t["alone"]):
            torch.testing.assert_close(got, want, **against("lerobot", "chunks"))
        assert versions == [None] * cases.n
        sender = WeightSender("gloo")
        sender.init_transfer(engine)
        bad = [("model.action_out_proj.weight", torch.zeros(3, 3)), ("model.no_such_layer.weight", torch.zeros(2)),
               ("model.state_proj.weight", weights["model.state_proj.weight"])]
        with pytest.raises(WeightUpdateRefusedError) as refused:
            sender.update(engine, bad, version=3)
        listed = " ".join(refused.value.problems)
        assert "model.no_such_layer.weight" in listed and "model.action_out_proj.weight" in listed
        unchanged, versions = chunks(engine, cases)
        for got, want in zip(unchanged, before):
            torch.testing.assert_close(got, want, **against("lerobot", "chunks"))  # nothing of the refused update was loaded
        assert versions == [None] * cases.n and engine.replica_status()[0].weight_version is None
        sender.update(engine, [(name, weights[name]) for name in CHANGED], version=7)
        after, versions = chunks(engine, cases)
        assert versions == [7] * cases.n and engine.replica_status()[0].weight_version == 7
    finally:
        engine.close()
    folder = tmp_path / "pretrained_model"
    shutil.copytree(DATA / "smolvla" / "pretrained_model", folder)
    save_file(weights, str(folder / "model.safetensors"))
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={**args_of("smolvla"), "model": str(folder)},
                           config=CPU)) as inline:
        want, _ = chunks(inline, cases)
    for got, new, old in zip(after, want, before):
        assert not torch.allclose(got, old, atol=1e-3)  # the update changed the chunks ...
        torch.testing.assert_close(got, new, **against("lerobot", "chunks"))  # ... to those of the new weights
