"""OpenAI's Videos API without Ray: the job store every group reads, the create call's fields, the MP4.

The routes against a real Serve app with the real `openai` client are in tests/test_diffusers_serve.py
(they share its deployed app).
"""

from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest

from phyai_ray.serve.protocols.openai.common import OpenAIError
from phyai_ray.serve.protocols.openai.mp4 import mp4_bytes, mp4_frames, psnr_luma, thumbnail_png
from phyai_ray.serve.protocols.openai.video_jobs import JobStore, public
from phyai_ray.serve.protocols.openai.videos import frames_of, job_request, reference_image


def make(store: JobStore, prompt: str = "p") -> dict:
    return store.create(model="m", prompt=prompt, size="32x32", seconds="1", owner="g")


def test_a_job_goes_queued_running_completed_and_its_files_are_served(tmp_path) -> None:
    store = JobStore(tmp_path, ttl_s=60)
    job = make(store)
    assert job["id"].startswith("video_") and len(job["id"]) == 6 + 32 and job["status"] == "queued"
    assert "owner" not in public(job) and public(job)["object"] == "video"
    assert store.update(job["id"], status="in_progress", progress=40)["progress"] == 40
    assert store.content(job["id"], "video") is None
    done = store.finish(job["id"], b"mp4", b"png")
    assert done["status"] == "completed" and done["progress"] == 100 and done["expires_at"] >= done["completed_at"]
    assert store.content(job["id"], "video") == b"mp4" and store.content(job["id"], "thumbnail") == b"png"
    assert store.update(job["id"], progress=3) is None  # a finished job never changes again


def test_a_second_store_on_the_same_directory_sees_every_job(tmp_path) -> None:
    """Two groups' ingresses: one runs the job, the other answers polls and DELETEs."""
    runs, polls = JobStore(tmp_path), JobStore(tmp_path)
    job = make(runs)
    runs.update(job["id"], status="in_progress", progress=10)
    assert polls.get(job["id"])["progress"] == 10
    assert polls.request_cancel(job["id"])["status"] == "in_progress"
    assert runs.cancel_requested(job["id"]) and polls.get(job["id"]) is None
    assert runs.update(job["id"], progress=20) is None and runs.finish(job["id"], b"x", b"y") is None
    assert polls.get(job["id"]) is None  # the running group's late writes do not bring it back


def test_a_delete_between_the_running_groups_check_and_its_save_still_deletes(tmp_path) -> None:
    """The DELETE lands after `update` found no flag but before it saved: the save must not bring the job back."""
    runs, polls = JobStore(tmp_path), JobStore(tmp_path)
    job = make(runs)
    save = runs._save

    def deleted_meanwhile(value: dict) -> None:
        assert polls.request_cancel(job["id"]) is not None
        save(value)

    runs._save = deleted_meanwhile
    assert runs.update(job["id"], status="in_progress", progress=30) is None
    runs._save = save
    assert polls.get(job["id"]) is None and runs.get(job["id"]) is None
    assert runs.update(job["id"], progress=40) is None  # the flag stays: later writes are refused too


def test_guessed_or_malformed_ids_find_nothing(tmp_path) -> None:
    store = JobStore(tmp_path)
    make(store)
    for ident in ("video_" + "0" * 32, "../etc/passwd", "video_../../x", "", "video_" + "a" * 80):
        assert store.get(ident) is None and store.content(ident, "video") is None


def test_a_job_whose_group_stopped_is_failed_by_its_next_reader(tmp_path) -> None:
    store = JobStore(tmp_path, stale_s=0.2)
    job = make(store)
    time.sleep(0.3)
    seen = store.get(job["id"])
    assert seen["status"] == "failed" and seen["error"]["code"] == "replica_unavailable"
    assert "stopped answering" in seen["error"]["message"]
    assert store.get(job["id"])["status"] == "failed"  # kept for its time to live, like any finished job


def test_finished_jobs_expire_and_the_size_cap_drops_the_oldest(tmp_path) -> None:
    store = JobStore(tmp_path, ttl_s=0.5, max_bytes=25)
    first, second = make(store), make(store)
    store.finish(first["id"], b"a" * 10, b"b" * 5)
    store.finish(second["id"], b"c" * 10, b"d" * 5)  # 30 bytes > 25: the oldest goes
    assert store.get(first["id"]) is None and store.get(second["id"])["status"] == "completed"
    time.sleep(0.6)
    assert store.get(second["id"]) is None and store.content(second["id"], "video") is None


def test_the_sweep_holds_the_disk_budget_over_50_jobs_and_expires_them_without_a_read(tmp_path) -> None:
    """50 jobs of 1,500 bytes each finish into a 20,000-byte budget; after each finish a sweep (what the
    routes' sweeper runs, no job read) leaves the store within the budget, newest kept; past the ttl
    one sweep removes every job's files, and nothing was read through get() by a caller."""
    store = JobStore(tmp_path, ttl_s=0.5, max_bytes=20_000)
    ids = []
    for i in range(50):
        job = make(store, f"p{i}")
        store.finish(job["id"], b"v" * 1000, b"t" * 500)
        ids.append(job["id"])
        store.sweep()
        held = sum(p.stat().st_size for p in tmp_path.glob("video_*") if p.suffix in (".mp4", ".png"))
        assert held <= 20_000, (i, held)
    assert {p.stem for p in tmp_path.glob("video_*.mp4")} == set(ids[-13:])  # 13 x 1,500 = 19,500
    time.sleep(0.6)
    assert store.sweep() == 0 and not list(tmp_path.glob("video_*"))


def test_list_pages_newest_first(tmp_path) -> None:
    store = JobStore(tmp_path)
    ids = []
    for i in range(5):
        ids.append(make(store, f"p{i}")["id"])
        path = tmp_path / f"{ids[-1]}.json"
        job = json.loads(path.read_text())
        job["created_at"] = 1000 + i  # distinct seconds, as jobs made a second apart
        path.write_text(json.dumps(job))
    page, more = store.list(limit=2)
    assert [j["id"] for j in page] == ids[::-1][:2] and more
    page, more = store.list(limit=2, after=page[-1]["id"])
    assert [j["id"] for j in page] == ids[::-1][2:4] and more
    page, more = store.list(limit=2, after=page[-1]["id"])
    assert [j["id"] for j in page] == [ids[0]] and not more
    assert [j["id"] for j in store.list(limit=10, order="asc")[0]] == ids


def test_size_and_seconds_become_the_plugin_fields_and_extra_fields_win() -> None:
    request, size, seconds, fps = job_request(
        {"prompt": "a robot", "size": "832x480", "seconds": "5", "num_inference_steps": "30", "seed": "7",
         "guidance_scale": "4.5", "negative_prompt": "blur"}, None, 16.0, 4)
    assert request == {"prompt": "a robot", "output_type": "uint8", "width": 832, "height": 480, "num_frames": 81,
                       "num_inference_steps": 30, "seed": 7, "guidance_scale": 4.5, "negative_prompt": "blur"}
    assert (size, seconds, fps) == ("832x480", "5", 16.0)
    request, *_ = job_request({"prompt": "a", "seconds": "5", "num_frames": 33, "fps": 24}, None, 16.0, 4)
    assert request["num_frames"] == 33 and "fps" not in request
    assert [frames_of(s, 16.0, 4) for s in ("0.01", "0.5", "2", 4)] == [5, 9, 33, 65]


@pytest.mark.parametrize("fields,param", [
    ({"size": "832by480"}, "size"), ({"seconds": "soon"}, "seconds"), ({"seconds": "-1"}, "seconds"),
    ({"num_frames": "9.5"}, "num_frames"), ({"guidance_scale": "nan"}, "guidance_scale"), ({"fps": 0}, "fps"),
    ({"prompt": ""}, "prompt")])
def test_a_bad_field_is_a_400_naming_it(fields, param) -> None:
    with pytest.raises(OpenAIError) as caught:
        job_request({"prompt": "a", **fields}, None, 16.0, 4)
    assert caught.value.status == 400 and caught.value.param == param, str(caught.value)


def test_input_reference_as_a_data_url() -> None:
    from PIL import Image

    picture = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert np.array_equal(reference_image({"image_url": url}), picture)
    for bad in ({"file_id": "file_1"}, {"image_url": "https://example.com/a.png"}, {"image_url": "data:x;base64,@@"}):
        with pytest.raises(OpenAIError, match="input_reference"):
            reference_image(bad)


def test_an_image_past_the_pixel_limit_is_a_400_before_it_is_decoded() -> None:
    """A 5000 x 4000 PNG (20 M pixels, past 4096 x 4096) and a decompression bomb past PIL's own bound
    (a 1-bit 20000 x 20000 PNG of 50 kB) are 400s naming input_reference and the limit."""
    from PIL import Image

    from phyai_ray.serve.protocols.openai.video_images import MAX_IMAGE_PIXELS, image_of

    for size, mode in (((5000, 4000), "L"), ((20000, 20000), "1")):
        buffer = io.BytesIO()
        Image.new(mode, size).save(buffer, format="PNG")
        with pytest.raises(OpenAIError, match=f"input_reference is .*past this server's limit of {MAX_IMAGE_PIXELS}") \
                as caught:
            image_of(buffer.getvalue())
        assert caught.value.status == 400 and caught.value.param == "input_reference"
    small = io.BytesIO()
    Image.new("RGB", (64, 48)).save(small, format="PNG")
    assert image_of(small.getvalue()).shape == (48, 64, 3)


def test_mp4_round_trip_within_the_codec_loss_and_the_thumbnail_is_exact() -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    x = np.linspace(0, 1, 48)
    smooth = np.stack([np.stack([*np.meshgrid(x + t / 9, x), np.full((48, 48), 0.5)], -1) for t in range(9)])
    video = np.clip((smooth % 1) * 200 + rng.normal(0, 8, smooth.shape), 0, 255).astype(np.uint8)
    data = mp4_bytes(video, fps=16)
    assert data[4:8] == b"ftyp"  # an ISO media file
    back = mp4_frames(data)
    assert back.shape == video.shape and psnr_luma(video, back) >= 30.0
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(thumbnail_png(video)))), video[0])
    odd = mp4_frames(mp4_bytes(video[:, :47, :45]), size=(45, 47))  # yuv420p pads an odd size; cropped back
    assert odd.shape == (9, 47, 45, 3)


# -- schemathesis on the routes, as tests/test_openapi_fuzz.py does on the others -------------------
@pytest.fixture(scope="module")
def video_schema(tmp_path_factory):
    """A world-model app over an inline engine (no Ray): a tiny Wan folder whose limits keep every job
    schemathesis can make small (9 frames, 32 x 32), so the jobs it starts end quickly."""
    pytest.importorskip("diffusers")
    import schemathesis

    from phyai_ray import Engine, EngineArgs
    from phyai_ray.serve.protocols.http import create_api
    from phyai_ray.serve.runtime.holder import EngineHolder
    from phyai_ray.serve.runtime.options import ServeOptions
    from phyai_ray.serve.runtime.runner import GroupRunner
    from tests.diffusers_folders import build_wan

    folder = build_wan(tmp_path_factory.mktemp("fuzz") / "wan")
    args = EngineArgs(plugin="diffusers_pipeline", config={"device": {"target": "cpu"}},
                      plugin_args={"model": str(folder), "max_frames": 9, "max_pixels": 32 * 32})
    with Engine(args) as engine:
        options = ServeOptions(api_key="k-videos", video_dir=str(tmp_path_factory.mktemp("jobs")))
        api = create_api(GroupRunner(EngineHolder(lambda: engine)), options)
        yield schemathesis.openapi.from_asgi("/openapi.json", api, headers={"Authorization": "Bearer k-videos"})


def test_two_tenants_list_read_and_delete_only_their_own_jobs(tmp_path) -> None:
    """Two API keys, two tenants, through the real openai client (over Starlette's TestClient, which runs
    the app and its job tasks): lab-a's job is listed for lab-a only; lab-b gets 404 on its retrieve,
    content, remix and delete, and the job is still lab-a's, completed, afterwards. With a 3 s ttl the
    job's files then go with no request at all (the sweeper the first request started)."""
    pytest.importorskip("diffusers")
    import openai
    from starlette.testclient import TestClient

    from phyai_ray import Engine, EngineArgs
    from phyai_ray.serve.protocols.http import create_api
    from phyai_ray.serve.runtime.holder import EngineHolder
    from phyai_ray.serve.runtime.options import ServeOptions
    from phyai_ray.serve.runtime.runner import GroupRunner
    from tests.diffusers_folders import build_wan

    folder = build_wan(tmp_path / "wan")
    args = EngineArgs(plugin="diffusers_pipeline", config={"device": {"target": "cpu"}},
                      plugin_args={"model": str(folder), "max_frames": 9, "max_pixels": 32 * 32})
    with Engine(args) as engine:
        options = ServeOptions(api_keys={"lab-a": "k-a", "lab-b": "k-b"}, video_dir=str(tmp_path / "jobs"),
                               video_ttl_s=3.0)
        with TestClient(create_api(GroupRunner(EngineHolder(lambda: engine)), options)) as http:
            a, b = (openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
                    for key in ("k-a", "k-b"))
            job = a.videos.create_and_poll(prompt="a cube", size="32x32", seconds="0.5", poll_interval_ms=20,
                                           extra_body={"num_inference_steps": 2, "seed": 1})
            assert job.status == "completed", job
            assert [v.id for v in a.videos.list()] == [job.id] and [v.id for v in b.videos.list()] == []
            for call in (lambda: b.videos.retrieve(job.id), lambda: b.videos.download_content(job.id),
                         lambda: b.videos.remix(job.id, prompt="x"), lambda: b.videos.delete(job.id)):
                with pytest.raises(openai.NotFoundError):
                    call()
            assert a.videos.retrieve(job.id).status == "completed"
            assert len(a.videos.download_content(job.id).read()) > 0
            finished = time.monotonic()
            while list((tmp_path / "jobs").glob("video_*")):  # the routes' sweeper, with no read in between
                assert time.monotonic() - finished < 10, list((tmp_path / "jobs").glob("video_*"))
                time.sleep(0.05)
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url="http://testserver/v1", api_key="k-c", http_client=http,
                              max_retries=0).videos.list()


def test_schemathesis_on_the_video_routes(video_schema) -> None:
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import CHECKS

    excluded = [check for check in CHECKS.get_all() if check.__name__ == "positive_data_acceptance"]
    operations = [op.ok() for op in video_schema.get_all_operations() if op.ok().path.startswith("/v1/videos")]
    assert sorted(f"{op.method.upper()} {op.path}" for op in operations) == [
        "DELETE /v1/videos/{video_id}", "GET /v1/videos", "GET /v1/videos/{video_id}",
        "GET /v1/videos/{video_id}/content", "POST /v1/videos", "POST /v1/videos/{video_id}/remix"]
    failures = {}
    for operation in operations:
        @given(operation.as_strategy())
        @settings(max_examples=10, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(headers={"Authorization": "Bearer k-videos"}, excluded_checks=excluded)

        try:
            run()
        except Exception as exc:  # every operation runs; all failures are reported together
            failures[f"{operation.method.upper()} {operation.path}"] = str(exc)[:1500]
    assert not failures, "\n\n".join(f"{name}:\n{text}" for name, text in failures.items())


def test_a_cosmos3_folders_video_is_made_and_stored_at_its_own_24_fps(tmp_path) -> None:
    """Cosmos3 conditions on its frame rate (24 by default): the Videos API passes the rate on as an input, the
    frames for `seconds` are counted at it, and the MP4 plays at it (it once held 24 fps content at 16 fps)."""
    import imageio.v3 as iio

    from phyai_ray.models.diffusers_pipeline.entry import DiffusersPipelineEntry
    from tests.cosmos3_folders import build_cosmos3

    entry = DiffusersPipelineEntry({"model": str(build_cosmos3(tmp_path / "cosmos3"))})
    assert (entry.video_fps, entry.video_fps_input) == (24.0, True)
    request, _, seconds, fps = job_request({"prompt": "a", "seconds": "1"}, None, entry.video_fps,
                                           entry.limits.temporal, entry.video_fps_input)
    assert fps == 24.0 and request["fps"] == 24.0 and request["num_frames"] == frames_of("1", 24.0,
                                                                                          entry.limits.temporal)
    assert entry.validate_request(request).fps == 24.0
    video = np.zeros((9, 32, 32, 3), dtype=np.uint8)
    assert iio.immeta(mp4_bytes(video, fps=fps), extension=".mp4")["fps"] == pytest.approx(24.0)
    wan = job_request({"prompt": "a", "seconds": "1", "fps": 24}, None, 16.0, 4)[0]  # Wan: the file's rate only
    assert "fps" not in wan and wan["num_frames"] == frames_of("1", 24.0, 4)
