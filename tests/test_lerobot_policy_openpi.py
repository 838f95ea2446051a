"""openpi-client robots against a real Serve app serving the tiny SmolVLA of tests/data/lerobot/ (CPU).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_lerobot_policy_openpi.py -q

Three robots run `openpi_client.WebsocketClientPolicy` in the clients' venv (tests/client_venv.py),
sending uint8 HWC camera frames, the state and the prompt under openpi's keys; their chunks must
equal `Engine.step` of the same frames on one inline rank, the metadata frame names the key
mapping, and robots share expert steps. A chunk's `server_timing["weight_version"]` is the version of
the weights that computed it, even when an update lands before its reply is sent.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from phyai_ray import DeploymentConfig, Engine, EngineArgs, EngineConfig, WeightSender
from phyai_ray.config.deployment import WorkerSupervisorConfig
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.serve.runtime.holder import EngineHolder
from phyai_ray.serve.protocols.openpi import _answer, pack, unpack
from phyai_ray.serve.runtime.runner import GroupRunner
from tests.client_venv import client_python, run_client
from tests.conftest import delete_serve_apps, shared_serve, wait_for_no_leaks
from tests.tolerances import against

KEY = "robot-key-lerobot"
ROOT = Path(__file__).resolve().parent / "data" / "lerobot" / "smolvla"
PLUGIN = "phyai_ray.models.lerobot_policy:LeRobotPolicyEntry"
ARGS = {"model": str(ROOT / "pretrained_model"), "vlm": str(ROOT / "backbone")}
CPU = EngineConfig(device=DeviceConfig(target="cpu"))


@pytest.fixture(scope="module")
def server() -> Any:
    from ray import serve

    from phyai_ray.serve import create_app

    client_python()  # build the clients' venv before the app holds the cluster
    port = shared_serve()["port"]
    deployment = DeploymentConfig.local(replica_count=1, cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(
        startup_timeout_s=120, execution_timeout_s=60))
    try:
        serve.run(create_app(EngineArgs(plugin=PLUGIN, plugin_args=ARGS, config=CPU), deployment, api_key=KEY),
                  name="lerobot", route_prefix="/")
        yield f"ws://127.0.0.1:{port}/v1/openpi"
    finally:
        delete_serve_apps()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


def openpi_frames() -> dict[str, np.ndarray]:
    t = load_file(str(ROOT / "cases.safetensors"))
    meta = json.loads((ROOT / "cases.json").read_text())
    top, wrist = meta["cameras"]
    out = {}
    for r in range(t["state"].shape[0]):
        out[f"image_{r}"] = (t[top][r] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        out[f"wrist_image_{r}"] = (t[wrist][r] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        out[f"state_{r}"] = t["state"][r].numpy()
        out[f"noise_{r}"] = t["noise"][r].numpy()
        out[f"prompt_{r}"] = np.array(meta["prompts"][r])
    return out


def test_openpi_client_robots_get_the_inline_engines_chunks(server: str, tmp_path: Path) -> None:
    frames = openpi_frames()
    path = tmp_path / "frames.npz"
    np.savez(path, **frames)
    out = run_client("lerobot_openpi_robots.py", server, KEY, str(path), "4", timeout_s=300)
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args=ARGS, config=CPU)) as engine:
        for r in range(3):
            robot = out[str(r)]
            assert robot["error"] is None, robot["error"]
            meta = robot["metadata"]
            assert meta["type"] == "smolvla" and meta["openpi_keys"]["observation/state"] == "observation.state"
            want = engine.step({"observation/image": frames[f"image_{r}"],
                                "observation/wrist_image": frames[f"wrist_image_{r}"],
                                "observation/state": frames[f"state_{r}"], "prompt": str(frames[f"prompt_{r}"]),
                                "noise": frames[f"noise_{r}"]})["actions"].numpy()
            assert len(robot["actions"]) == 4
            for actions in robot["actions"]:
                np.testing.assert_allclose(np.array(actions, dtype=np.float32), want, **against("lerobot", "chunks"))
    assert max(max(out[str(r)]["batch_sizes"]) for r in range(3)) >= 2  # robots shared expert steps


class UpdateAfterChunk(GroupRunner):
    """The group runner of the edge, with a trainer's weight update landing after the next chunk is
    computed and before the edge builds that chunk's reply (what a concurrent update does at worst)."""

    def __init__(self, engine: Engine, update: Any) -> None:
        super().__init__(EngineHolder(lambda: engine))
        self.update = update

    async def run(self, request: Any, **kwargs: Any) -> Any:
        value = await super().run(request, **kwargs)
        if self.update is not None:
            update, self.update = self.update, None
            await asyncio.to_thread(update)
        return value


def test_each_chunk_names_the_weight_version_that_computed_it(ray_session) -> None:
    from tests.test_lerobot_policy_weights import CHANGED, trained

    frames = openpi_frames()
    frame = pack({"observation/image": frames["image_0"], "observation/wrist_image": frames["wrist_image_0"],
                  "observation/state": frames["state_0"], "prompt": str(frames["prompt_0"]),
                  "noise": frames["noise_0"]})
    options = SimpleNamespace(max_tensor_bytes=1 << 24, overload_status=503)
    first = load_file(str(ROOT / "pretrained_model" / "model.safetensors"))
    engine = Engine(EngineArgs(plugin=PLUGIN, plugin_args=ARGS, config=CPU),
                    DeploymentConfig(mode="local", replica_count=1, cpus_per_rank=0.5))
    try:
        sender = WeightSender("gloo")
        sender.init_transfer(engine)
        sender.update(engine, [(name, first[name]) for name in CHANGED], version=1)
        new = trained()
        runner = UpdateAfterChunk(engine, lambda: sender.update(engine, [(n, new[n]) for n in CHANGED], version=2))
        replies = []
        for rid in ("before", "after"):
            reply, fatal = asyncio.run(_answer(frame, runner, options, rid))
            assert not fatal and not isinstance(reply, str), reply
            replies.append(unpack(reply, 1 << 24))
        assert runner.update is None and engine.replica_status()[0].weight_version == 2  # the update landed
    finally:
        engine.close()
    before, after = replies
    assert before["server_timing"]["weight_version"] == 1  # computed by version 1, replied after version 2 came
    assert after["server_timing"]["weight_version"] == 2
    assert not np.allclose(before["actions"], after["actions"], atol=1e-3)  # the update changed the chunk
