"""`diffusers_pipeline` over HTTP: a real Serve app of a tiny Wan 2.1 folder, with real clients.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_diffusers_serve.py -q

The JSON route (`/v1/step`) and its streamed form (`/v1/step/stream`, one JSON object per line)
are called with `requests`; the Open Inference Protocol v2 with the real `tritonclient.http`
client: the prompt a BYTES input of shape [1], the other fields request parameters, the video a
UINT8 output (FP32 for output_type "float"). Every video equals the inline Engine's for the same
seed (one rank, no Ray: the same step loop, so bit for bit). A bad request is refused with the rule
named (422 on the JSON route, 400 on OIP) and the app serves the next one.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import requests
import torch

from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, WorkerSupervisorConfig
from phyai_ray.serve.protocols import codec
from tests.conftest import delete_serve_apps, shared_serve, wait_for_no_leaks
from tests.diffusers_folders import build_wan

pytest.importorskip("diffusers")
tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402
from tests.tolerances import against

PLUGIN = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"
APP = "world"
PROMPT = "a robot arm picks up the red cube"
FIELDS = {"negative_prompt": "blue box", "height": 32, "width": 32, "num_frames": 9, "max_sequence_length": 16,
          "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 5}
REQUEST = {"prompt": PROMPT, **FIELDS}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_wan(tmp_path_factory.mktemp("serve") / "wan21")


@pytest.fixture(scope="module")
def expected(folder) -> dict[str, torch.Tensor]:
    """The inline Engine's videos (uint8, float) of REQUEST, and its latents."""
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder)})) as engine:
        return {kind: engine.step({**REQUEST, "output_type": kind})["video"] for kind in ("uint8", "float", "latent")}


@pytest.fixture(scope="module")
def server(folder) -> dict[str, Any]:
    from ray import serve

    from phyai_ray.serve import create_app

    port = shared_serve()["port"]
    args = EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder)},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    deployment = DeploymentConfig.local(replica_count=1, cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(
        startup_timeout_s=120, execution_timeout_s=120))
    try:
        serve.run(create_app(args, deployment, video_stale_s=5), name=APP, route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "host": f"127.0.0.1:{port}", "model": folder.name}
    finally:
        delete_serve_apps()
        actors, groups = wait_for_no_leaks(30)
        assert not actors and not groups, f"left behind: {actors} {groups}"


def same(video: torch.Tensor, want: torch.Tensor, kind: str) -> None:
    """Latents and uint8 frames equal the inline engine's exactly; the VAE's float output may differ in
    the last bits (the rank actor runs its convolutions with another number of threads than this process)."""
    if kind == "float":
        torch.testing.assert_close(video, want, **against("diffusers", "batched"))
    else:
        assert torch.equal(video, want)


def step(server: dict[str, Any], body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{server['url']}/v1/step", json=codec.encode(body), timeout=120)


@pytest.mark.parametrize("kind", ["uint8", "float", "latent"])
def test_json_route_equals_the_inline_engine(server: dict, expected: dict, kind: str) -> None:
    reply = step(server, {**REQUEST, "output_type": kind})
    assert reply.status_code == 200, reply.text
    video = codec.decode(reply.json()["result"])["video"]
    assert video.dtype == expected[kind].dtype
    same(video, expected[kind], kind)
    if kind == "uint8":
        assert list(video.shape) == [9, 32, 32, 3]


def test_json_stream_reports_each_step_then_the_video(server: dict, expected: dict) -> None:
    with requests.post(f"{server['url']}/v1/step/stream", json=REQUEST, stream=True, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"] == "application/x-ndjson", reply.text
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    *progress, last = lines
    steps = [p["step"] for p in progress]
    assert progress and all(p == {"step": s, "of": 3} for p, s in zip(progress, steps)), lines[:-1]
    assert steps == sorted(set(steps)) and steps[-1] == 3  # a lagging reader may miss a report, never the last
    assert torch.equal(codec.decode(last)["video"], expected["uint8"])


def oip_infer(server: dict[str, Any], kind: str | None = None, binary: bool = True, **extra: Any) -> Any:
    client = tritonclient_http.InferenceServerClient(server["host"], network_timeout=120)
    prompt = tritonclient_http.InferInput("prompt", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_), binary_data=binary)
    params = {**FIELDS, **({"output_type": kind} if kind else {}), **extra}
    wanted = [tritonclient_http.InferRequestedOutput("video", binary_data=binary)]
    return client.infer(server["model"], [prompt], outputs=wanted, parameters=params)


@pytest.mark.parametrize("kind,binary", [(None, True), (None, False), ("float", True)],
                         ids=["uint8-binary", "uint8-json", "float-binary"])
def test_oip_with_tritonclient_equals_the_inline_engine(server: dict, expected: dict, kind: str | None,
                                                        binary: bool) -> None:
    result = oip_infer(server, kind, binary)
    out = result.get_output("video")
    assert out["datatype"] == ("FP32" if kind == "float" else "UINT8") and out["shape"] == [9, 32, 32, 3]
    same(torch.from_numpy(result.as_numpy("video")), expected[kind or "uint8"], kind or "uint8")


def test_oip_metadata_lists_the_prompt_and_the_video(server: dict) -> None:
    client = tritonclient_http.InferenceServerClient(server["host"])
    meta = client.get_model_metadata(server["model"])
    assert meta["inputs"] == [{"name": "prompt", "datatype": "BYTES", "shape": [1]}]  # Wan: no conditioning frames
    assert meta["outputs"] == [{"name": "video", "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
                               {"name": "steps", "datatype": "INT64", "shape": []}]


def test_bad_requests_are_refused_naming_the_rule_and_the_app_serves_on(server: dict, expected: dict) -> None:
    reply = step(server, {**REQUEST, "num_frames": 8})
    assert reply.status_code == 422 and "4k+1" in reply.json()["error"]["message"], reply.text
    reply = requests.post(f"{server['url']}/v1/step/stream", json={**REQUEST, "width": 40}, timeout=60)
    assert reply.status_code == 422 and "multiple of" in reply.json()["error"]["message"], reply.text
    for extra, named in (({"num_frames": 8}, "4k+1"), ({"num_frame": 9}, "num_frame"),
                         ({"output_type": "mp4"}, "output_type")):
        with pytest.raises(InferenceServerException) as info:
            oip_infer(server, **extra)
        assert info.value.status() == "400" and named in info.value.message(), info.value.message()
    with pytest.raises(InferenceServerException) as info:  # Wan takes no conditioning frames: not in its signature
        client = tritonclient_http.InferenceServerClient(server["host"])
        prompt = tritonclient_http.InferInput("prompt", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
        image = tritonclient_http.InferInput("image", [32, 32, 3], "UINT8")
        image.set_data_from_numpy(np.zeros((32, 32, 3), dtype=np.uint8))
        client.infer(server["model"], [prompt, image], parameters=FIELDS)
    assert info.value.status() == "400" and "unknown input(s) ['image']" in info.value.message()
    assert np.array_equal(oip_infer(server).as_numpy("video"), expected["uint8"].numpy())


class _Runner:
    """A group whose stream is scripted: the stream route's own rules, without Ray or a model."""

    entry = None

    def __init__(self, script: list[list[tuple[str, Any]]]) -> None:
        self.script, self.closed = script, False

    async def stream(self, request: Any) -> Any:
        try:
            for items in self.script:
                yield items
        finally:
            self.closed = True


@pytest.mark.parametrize("script,lines", [
    ([[("chunk", {"step": 1, "of": 1}), ("chunk", {"video": 1})], [("end", {"video": 1})]],
     [{"step": 1, "of": 1}, {"video": 1}]),  # a value stream's last chunk is its result: not sent twice
    ([[("chunk", {"index": 0, "token_ids": [5]})], [("end", [{"token_ids": [5]}])]],
     [{"index": 0, "token_ids": [5]}, [{"token_ids": [5]}]]),  # a token stream: the result follows its chunks
], ids=["value", "tokens"])
def test_the_stream_route_writes_each_chunk_then_the_result_once(script: list, lines: list) -> None:
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from phyai_ray.serve.runtime.options import ServeOptions
    from phyai_ray.serve.protocols.step_stream import add_step_stream_route

    api, runner = FastAPI(), _Runner(script)
    add_step_stream_route(api, runner, ServeOptions(), lambda entry, raw, options: raw)
    with TestClient(api) as client:
        reply = client.post("/v1/step/stream", json={"prompt": "x"})
    assert reply.status_code == 200 and [json.loads(line) for line in reply.text.splitlines()] == lines
    assert runner.closed


def test_a_failure_after_the_first_line_is_the_last_line() -> None:
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from phyai_ray.serve.runtime.options import ServeOptions
    from phyai_ray.serve.protocols.step_stream import add_step_stream_route

    api, runner = FastAPI(), _Runner([[("chunk", {"step": 1, "of": 2})], [("error", RuntimeError("rank 0 died"))]])
    add_step_stream_route(api, runner, ServeOptions(), lambda entry, raw, options: raw)
    with TestClient(api) as client:
        reply = client.post("/v1/step/stream", json={"prompt": "x"})
        not_json = client.post("/v1/step/stream", content=b"{nope")
    first, last = [json.loads(line) for line in reply.text.splitlines()]
    assert first == {"step": 1, "of": 2} and set(last) == {"error"} and "rank 0 died" in last["error"]["message"]
    assert not_json.status_code == 400 and "not JSON" in not_json.text


# -- OpenAI's Videos API (serve/protocols/openai/videos.py) with the real openai client ----------------
VIDEO_EXTRA = {name: FIELDS[name] for name in ("negative_prompt", "num_inference_steps", "guidance_scale", "seed",
                                                "max_sequence_length")}


def video_client(server: dict[str, Any]) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="not-checked", max_retries=0, timeout=60)


def test_videos_api_create_poll_download_and_list(server: dict, expected: dict) -> None:
    """The MP4 holds the served frames within the codec's loss (CRF 12, yuv420p: luma PSNR >= 30 dB); the
    thumbnail is the first frame exactly (PNG)."""
    import io

    from PIL import Image

    from phyai_ray.serve.protocols.openai.mp4 import mp4_frames, psnr_luma

    client = video_client(server)
    video = client.videos.create_and_poll(prompt=PROMPT, size="32x32", seconds="0.5", extra_body=VIDEO_EXTRA,
                                          poll_interval_ms=50)
    assert video.status == "completed" and video.progress == 100 and video.error is None, video
    assert (video.size, video.seconds, video.object) == ("32x32", "0.5", "video")
    frames = mp4_frames(client.videos.download_content(video.id).read())
    want = expected["uint8"].numpy()
    assert frames.shape == want.shape and psnr_luma(frames, want) >= 30.0
    thumbnail = client.videos.download_content(video.id, variant="thumbnail").read()
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(thumbnail)).convert("RGB")), want[0])
    assert video.id in [v.id for v in client.videos.list(limit=1)]  # auto-paging walks every page
    assert client.videos.list(limit=1).data[0].id == video.id  # newest first


def test_video_progress_rises_and_delete_stops_a_long_job(server: dict) -> None:
    import openai

    client = video_client(server)
    long = client.videos.create(prompt=PROMPT, size="32x32", seconds="0.5",
                                extra_body={**VIDEO_EXTRA, "num_inference_steps": 200})
    seen, began = [], time.monotonic()
    while not seen or seen[-1][1] < 10:  # progress 10: 20 of 200 steps done
        job = client.videos.retrieve(long.id)
        assert job.status in ("queued", "in_progress") and time.monotonic() - began < 60, job
        seen.append((time.monotonic(), job.progress))
    progress = [p for _, p in seen]
    assert progress == sorted(progress) and len({p for p in progress if 0 < p < 100}) >= 2, progress
    started = next(t for t, p in seen if p > 0)
    per_step = (seen[-1][0] - started) / max(seen[-1][1] * 2 - 1, 1)  # progress p ~ step 2p of 200
    client.videos.delete(long.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(long.id)
    sent = time.monotonic()
    short = client.videos.create_and_poll(prompt=PROMPT, size="32x32", seconds="0.5", extra_body=VIDEO_EXTRA,
                                          poll_interval_ms=50)
    waited = time.monotonic() - sent
    assert short.status == "completed", short
    left = per_step * (200 - 2 * seen[-1][1])  # what the long job still had to do when it was deleted
    assert waited < max(left / 2, 2.0), (waited, left)


def test_video_progress_never_falls_and_reads_100_only_once_completed(server: dict) -> None:
    """Polled back to back through the job's denoising and its decode (a chunk that names no step): the
    progress never goes back (it once fell from 99 to 0 while the decode ran) and is 100 only when the
    job is completed."""
    client = video_client(server)
    job = client.videos.create(prompt=PROMPT, size="32x32", seconds="0.5",
                               extra_body={**VIDEO_EXTRA, "num_inference_steps": 100})
    polls, began = [], time.monotonic()
    while not polls or polls[-1][0] not in ("completed", "failed"):
        seen = client.videos.retrieve(job.id)
        polls.append((seen.status, seen.progress))
        assert time.monotonic() - began < 120, polls[-5:]
    progress = [p for _, p in polls]
    assert polls[-1] == ("completed", 100) and len(polls) >= 50, (polls[-3:], len(polls))
    assert progress == sorted(progress), progress
    assert all(p < 100 for status, p in polls if status != "completed"), polls


def test_video_bad_fields_are_400s_naming_the_field(server: dict) -> None:
    import openai

    client = video_client(server)
    for size, extra, named in (("32by32", {}, "size"), ("40x32", {}, "width"),
                               ("32x32", {"num_frames": 8}, "num_frames"),
                               ("32x32", {"num_inference_steps": "many"}, "num_inference_steps")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.videos.create(prompt=PROMPT, size=size, seconds="0.5", extra_body={**VIDEO_EXTRA, **extra})
        assert named in str(caught.value), (size, extra, str(caught.value))
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_" + "0" * 32)


def test_remix_and_an_oversized_image_are_400s_that_say_why(server: dict) -> None:
    """The openai client's `remix` on a finished job: a 400 saying remix is not offered (an unknown id: 404);
    an input_reference of 5000 x 4000 pixels: a 400 naming it and the limit, before it is decoded."""
    import io

    import openai
    from PIL import Image

    client = video_client(server)
    video = client.videos.create_and_poll(prompt=PROMPT, size="32x32", seconds="0.5", extra_body=VIDEO_EXTRA,
                                          poll_interval_ms=50)
    with pytest.raises(openai.BadRequestError, match="remix is not offered by this server"):
        client.videos.remix(video.id, prompt="the same, at night")
    with pytest.raises(openai.NotFoundError):
        client.videos.remix("video_" + "0" * 32, prompt="anything")
    assert client.videos.retrieve(video.id).status == "completed"
    picture = io.BytesIO()
    Image.new("L", (5000, 4000)).save(picture, format="PNG")
    with pytest.raises(openai.BadRequestError, match="input_reference is 5000 x 4000 = 20000000 pixels, past"):
        client.videos.create(prompt=PROMPT, size="32x32", seconds="0.5", extra_body=VIDEO_EXTRA,
                             input_reference=("big.png", picture.getvalue(), "image/png"))


def test_a_video_job_on_a_killed_group_ends_failed_with_its_reason(server: dict) -> None:
    """The last test of the module: it kills the group's rank. One rank runs in the group's Serve replica,
    so the ingress running the job dies with it: the next reader fails the job once no report came for
    video_stale_s (5 s here)."""
    import os
    import signal

    client = video_client(server)
    job = client.videos.create(prompt=PROMPT, size="32x32", seconds="0.5",
                               extra_body={**VIDEO_EXTRA, "num_inference_steps": 400})
    began = time.monotonic()
    while client.videos.retrieve(job.id).progress < 2:
        assert time.monotonic() - began < 60
    [group] = requests.get(f"{server['url']}/v1/replicas", timeout=30).json()["replicas"]
    os.kill(group["pids"][0], signal.SIGKILL)
    killed = time.monotonic()
    while (seen := client.videos.retrieve(job.id)).status != "failed":
        assert seen.status == "in_progress" and time.monotonic() - killed < 60, seen  # never open for good
        time.sleep(0.1)
    assert seen.error.code in ("unavailable", "replica_unavailable") and PROMPT not in seen.error.message, seen.error
    # the app's only Serve replica died: polls are answered again once Serve replaced it (its health check)
    assert time.monotonic() - killed < 60, "the job stayed open long after video_stale_s"
