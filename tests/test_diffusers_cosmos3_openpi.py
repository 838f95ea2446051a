"""A Cosmos3 policy folder behind openpi's WebSocket, driven by the unmodified openpi-client (CPU).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_diffusers_cosmos3_openpi.py -q

The tiny random Cosmos3 folder of tests/cosmos3_folders.py (it has an action head) is served by a real
Serve app on the session's Serve instance, with plugin_args["policy"] giving what every openpi frame
asks for (a DROID chunk of 4 at tier 256, 2 denoising steps). Two robots run
`openpi_client.WebsocketClientPolicy` at once in the clients' venv (tests/client_venv.py), one
sending its camera HWC, the other CHW: the metadata frame names the chunk, the action width and the
keys; every reply's "actions" equals diffusers' `Cosmos3OmniPipeline` for the same image, prompt
and the frame's seed to 1e-5; a frame without its camera gets an error frame and the session goes on;
the robots share denoising steps (a reply with batch_size 2). The mapping itself (keys, refusals,
metadata) is checked on the Entry, without Ray.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from phyai_ray import DeploymentConfig, EngineArgs, EngineConfig  # noqa: E402
from phyai_ray.config.deployment import WorkerSupervisorConfig  # noqa: E402
from phyai_ray.config.engine import DeviceConfig  # noqa: E402
from tests.client_venv import client_python, run_client  # noqa: E402
from tests.conftest import delete_serve_apps, shared_serve, wait_for_no_leaks  # noqa: E402
from tests.test_diffusers_cosmos3 import IMAGE, action, folder, pipe, reference  # noqa: E402, F401
from tests.tolerances import against

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)

KEY = "robot-key-cosmos3"
POLICY = {"chunk_size": 4, "domain_name": "droid_lerobot", "resolution_tier": 256, "num_inference_steps": 2}
PROMPTS = ("a robot arm picks up the red cube", "place the green box in the blue bin")
OTHER = np.random.default_rng(5).integers(0, 256, (64, 80, 3), dtype=np.uint8)  # robot 1's camera, sent CHW
STEPS = 3


@pytest.fixture(scope="module")
def server(folder) -> Any:  # noqa: F811
    from ray import serve

    from phyai_ray.serve import create_app

    client_python()  # build the clients' venv before the app holds the cluster
    port = shared_serve()["port"]
    deployment = DeploymentConfig.local(replica_count=1, cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(
        startup_timeout_s=120, execution_timeout_s=60))
    args = EngineArgs(plugin="diffusers_pipeline", plugin_args={"model": str(folder), "policy": POLICY},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    try:
        serve.run(create_app(args, deployment, api_key=KEY), name="cosmos3", route_prefix="/")
        yield f"ws://127.0.0.1:{port}/v1/openpi"
    finally:
        delete_serve_apps()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


def expected(pipe, image: np.ndarray, prompt: str, seed: int) -> torch.Tensor:  # noqa: F811
    """diffusers' chunk for the action request a frame means (module docstring of cosmos3_request.py)."""
    r = {**action("policy", seed=seed, prompt=prompt, num_inference_steps=POLICY["num_inference_steps"]),
         "image": image}
    return reference(pipe, r)["action"]


def test_openpi_client_robots_get_diffusers_chunks(server: str, pipe, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "frames.npz"
    np.savez(path, image_0=IMAGE, image_1=np.ascontiguousarray(OTHER.transpose(2, 0, 1)),
             prompt_0=np.array(PROMPTS[0]), prompt_1=np.array(PROMPTS[1]))
    out = run_client("cosmos3_openpi_robots.py", server, KEY, str(path), str(STEPS), timeout_s=300)
    for r, image in enumerate((IMAGE, OTHER)):
        robot = out[str(r)]
        assert robot["error"] is None, robot["error"]
        meta = robot["metadata"]
        assert (meta["chunk_size"], meta["action_horizon"], meta["action_dim"], meta["num_steps"]) == (4, 4, 10, 2)
        assert set(meta["openpi_keys"]) == {"observation/image", "prompt", "seed"}
        assert "lacks ['observation/image']" in robot["refused"], robot["refused"]  # and the session went on
        assert robot["seeds"] == [10 * r + step for step in range(STEPS)]
        for seed, actions in zip(robot["seeds"], robot["actions"]):
            want = expected(pipe, image, PROMPTS[r], seed)
            np.testing.assert_allclose(np.array(actions, dtype=np.float32), want.numpy(), **against("diffusers", "batched"))
    assert max(max(out[str(r)]["batch_sizes"]) for r in range(2)) >= 2  # the robots shared denoising steps


def test_frames_map_onto_action_requests_in_the_dispatcher(folder, pipe) -> None:  # noqa: F811
    from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry
    from phyai_ray.models.diffusers_pipeline.folder import PipelineFolderError
    from phyai_ray.models.diffusers_pipeline.request import VideoRequestError

    entry = DiffusersPipelineEntry({"model": str(folder), "policy": {**POLICY, "seed": 7}})
    frame = entry.validate_request({"observation/image": IMAGE, "prompt": PROMPTS[0], "observation/state": [0.0]})
    assert frame.openpi and frame.seed == 7 and frame.output_type == "latent"  # the policy's seed; no video decode
    assert frame.action == {"mode": "policy", "chunk_size": 4, "domain_name": "droid_lerobot",
                            "resolution_tier": 256, "view_point": "ego_view", "raw_actions": None}
    chw = entry.validate_request({"observation/image": IMAGE.transpose(2, 0, 1), "prompt": PROMPTS[0], "seed": 3})
    assert chw.seed == 3 and np.array_equal(chw.image, IMAGE)
    plain = entry.validate_request(action("policy"))  # Cosmos3's own requests keep their shape
    assert not plain.openpi and plain.output_type == "float"
    reply = entry.gather(frame, [{"video": torch.zeros(1), "action": torch.ones(4, 10), "steps": 2}])
    assert set(reply) == {"actions", "steps"} and reply["actions"].shape == (4, 10)
    for bad, rule in [({"prompt": PROMPTS[0]}, "lacks \\['observation/image'\\]"),
                      ({"observation/image": IMAGE}, "lacks \\['prompt'\\]"),
                      ({"observation/image": IMAGE, "prompt": "x", "state": [0.0]}, "unknown openpi frame keys"),
                      ({"observation/image": IMAGE[..., :2], "prompt": "x"}, "uint8 \\[H, W, 3\\]")]:
        with pytest.raises(VideoRequestError, match=rule):
            entry.validate_request(bad)
    with pytest.raises(VideoRequestError, match="plugin_args\\['policy'\\]"):  # a folder served without one
        DiffusersPipelineEntry({"model": str(folder)}).validate_request({"observation/image": IMAGE, "prompt": "x"})
    for policy, rule in [({"chunk_size": 4}, "chunk_size and domain_name"), ({**POLICY, "mode": "inverse_dynamics"},
                                                                             "mode: 'policy'"),
                         ({**POLICY, "domain_name": "libero"}, "libero"), ({**POLICY, "resolution_tier": 300}, "300")]:
        with pytest.raises(PipelineFolderError, match=rule):
            DiffusersPipelineEntry({"model": str(folder), "policy": policy})
    from phyai_ray.models.diffusers_pipeline.cosmos3_request import Policy

    mute = SimpleNamespace(class_name="Cosmos3OmniPipeline", path="/models/mute", configs={"vae": {}},
                           transformer_config=lambda: {"action_gen": False}, components=lambda: {})
    with pytest.raises(PipelineFolderError, match="has an action head .* /models/mute has none"):
        Policy.of(POLICY, mute)
