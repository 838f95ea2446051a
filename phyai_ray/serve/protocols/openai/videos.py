"""OpenAI's Videos API for world-model plugins (`Entry.generates_video = True`: diffusers_pipeline).

    POST   /v1/videos                 JSON or multipart form (the openai client sends a form): model,
                                      prompt, size "WIDTHxHEIGHT", seconds, input_reference (an image:
                                      a file in the form, or {"image_url": "data:image/png;base64,..."});
                                      the plugin's own fields as extra fields, which win: num_frames,
                                      num_inference_steps, guidance_scale, guidance_scale_2, seed,
                                      negative_prompt, max_sequence_length, fps.
                                      -> the job at once: {"id", "object": "video", "status": "queued", ...}
    GET    /v1/videos/{id}            status queued / in_progress / completed / failed, progress 0-100
                                      (denoising steps done), error when failed
    GET    /v1/videos/{id}/content    video/mp4 (H.264, yuv420p; mp4.py); variant=thumbnail: a PNG
    DELETE /v1/videos/{id}            a queued job is removed, a running one cancelled (its slot frees at
                                      the next iteration), a finished one's files deleted
    GET    /v1/videos                 newest first; limit, after, order
    POST   /v1/videos/{id}/remix      not offered: a 400 saying so (404 for an unknown id)

An input_reference past MAX_IMAGE_PIXELS (4096 x 4096) is a 400 before it is decoded. With several
API keys (`ServeOptions.api_keys`, each key a tenant) a job belongs to the tenant whose key created it:
the list shows only the caller's jobs, and another tenant's id is a 404 on every route.

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    video = client.videos.create_and_poll(prompt="a robot arm stacks cubes", size="832x480", seconds="2",
                                          extra_body={"num_inference_steps": 30, "seed": 7})
    client.videos.download_content(video.id).write_to_file("robot.mp4")

`seconds` becomes frames at the job's fps (the `fps` field, else the plugin's `video_fps`: the rate its
content is made at, 24 for Cosmos3, which also takes the fps as an input), rounded to
the VAE's temporal stride (frames = stride x k + 1). The job runs as a stream on the group whose
ingress took the POST; its progress, its MP4 and its thumbnail go into the job store
(video_jobs.py), which every group reads, so a poll, download or DELETE may land on any group. A
job whose group fails is marked failed with the reason (it is not retried: a started video would
be computed twice); one whose group stops answering altogether is failed by the next reader.
Errors have OpenAI's shape; a bad field is a 400 naming it (`param`).
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from phyai_ray.serve.protocols.error_map import classify
from phyai_ray.serve.protocols.openai.common import OpenAIError, openai_error
from phyai_ray.serve.protocols.openai.mp4 import mp4_bytes, thumbnail_png
from phyai_ray.serve.protocols.openai.video_images import image_of, reference_image
from phyai_ray.serve.protocols.openai.video_jobs import (FINISHED, JobStore, default_directory, public,
                                                        sweep_interval)
from phyai_ray.validation import validate

INTEGERS = ("num_frames", "num_inference_steps", "seed", "max_sequence_length", "height", "width")
FLOATS = ("guidance_scale", "guidance_scale_2", "fps")
TEXTS = ("negative_prompt",)
HEARTBEATS = 5  # the running group touches its job this often per stale_s (the store fails it after that)
POLL_AFTER_MS = "250"  # the openai client's poll helper waits this long between polls
_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")
CREATE_SCHEMA = {  # the create call's body as the OpenAPI document shows it (validated by job_request, then the plugin)
    "type": "object", "required": ["prompt"], "additionalProperties": True, "properties": {
        "prompt": {"type": "string", "minLength": 1}, "model": {"type": "string"},
        "size": {"type": "string", "pattern": "^[0-9]{1,5}[xX][0-9]{1,5}$", "description": "WIDTHxHEIGHT"},
        "seconds": {"type": "string", "description": "the clip's length; frames = seconds x fps, 4k + 1"},
        "input_reference": {"type": "object", "properties": {"image_url": {"type": "string"}},
                            "description": "an image: {'image_url': 'data:image/png;base64,...'}"},
        **{name: {"type": "integer", "minimum": 0} for name in INTEGERS},
        **{name: {"type": "number"} for name in FLOATS}, **{name: {"type": "string"} for name in TEXTS}}}


def job_request(fields: dict[str, Any], image: np.ndarray | None, fps: float,
                stride: int, fps_input: bool = False) -> tuple[dict, str, str, float]:
    """The plugin's request of a create call's fields (form values are strings), its size and seconds as
    the job shows them, and the MP4's frame rate: `fps` is the file's, and a model input too where the
    plugin says so (`fps_input`: Cosmos3 conditions on it), so the file plays the content at its rate."""
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise OpenAIError(400, "prompt is required: a non-empty string", param="prompt")
    request: dict[str, Any] = {"prompt": prompt, "output_type": "uint8"}
    size = fields.get("size")
    if size is not None:
        match = _SIZE.match(str(size))
        if match is None:
            raise OpenAIError(400, f"size {size!r} is not WIDTHxHEIGHT (e.g. '832x480')", param="size")
        request["width"], request["height"] = int(match[1]), int(match[2])
    for name in INTEGERS + FLOATS + TEXTS:
        if fields.get(name) is not None:
            request[name] = _typed(name, fields[name])
    fps = float(request.pop("fps", fps))
    if not math.isfinite(fps) or fps <= 0:
        raise OpenAIError(400, f"fps must be a positive number; got {fps}", param="fps")
    if fps_input:
        request["fps"] = fps
    seconds = fields.get("seconds")
    if seconds is not None and "num_frames" not in request:
        request["num_frames"] = frames_of(seconds, fps, stride)
    if image is not None:
        request["image"] = image
    shown_size = f"{request['width']}x{request['height']}" if "width" in request and "height" in request else \
        str(size or "default")
    shown_seconds = str(seconds) if seconds is not None else \
        (f"{(request['num_frames'] - 1) / fps:g}" if "num_frames" in request else "default")
    return request, shown_size, shown_seconds, fps


def frames_of(seconds: Any, fps: float, stride: int) -> int:
    """Frames for `seconds` at `fps`, rounded to the nearest stride x k + 1 (k >= 1)."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        raise OpenAIError(400, f"seconds {seconds!r} is not a number", param="seconds") from None
    if not math.isfinite(value) or value <= 0 or value > 3600:
        raise OpenAIError(400, f"seconds must lie in (0, 3600]; got {seconds!r}", param="seconds")
    return stride * max(round(value * fps / stride), 1) + 1


def _typed(name: str, value: Any) -> Any:
    if name in TEXTS:
        return str(value)
    try:
        if name in INTEGERS:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        number = float(value)
        if not math.isfinite(number):
            raise ValueError
        return number
    except (TypeError, ValueError):
        kind = "an integer" if name in INTEGERS else "a number"
        raise OpenAIError(400, f"{name} must be {kind}; got {value!r}", param=name) from None


class VideoJobs:
    """The routes' state on one group: the store every group shares, and the jobs this group runs."""

    def __init__(self, runner: Any, options: Any) -> None:
        self.runner, self.entry = runner, runner.entry
        self.name = options.model_name or self.entry.served_name()
        directory = options.video_dir or default_directory(re.sub(r"[^A-Za-z0-9_.-]", "_", self.name))
        self.store = JobStore(directory, ttl_s=options.video_ttl_s, max_bytes=options.video_max_bytes,
                              stale_s=options.video_stale_s)
        self.crf, self.overload_status = options.video_crf, options.overload_status
        self.fps = float(getattr(self.entry, "video_fps", 16.0))  # the model's own rate (Cosmos3: 24)
        self.fps_input = bool(getattr(self.entry, "video_fps_input", False))
        self.tasks: dict[str, asyncio.Task] = {}
        self.sweeper: asyncio.Task | None = None  # started by the first request (the ingress's event loop)

    def sweep_from_now(self) -> None:
        """Start the store's sweeper on this event loop, once: expiry and the disk budget hold without reads."""
        if self.sweeper is None or self.sweeper.done():
            self.sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.store.sweep)
            except OSError:  # a shared directory that hiccuped: the next sweep tries again
                pass
            await asyncio.sleep(sweep_interval(self.store.ttl_s))

    def stride(self) -> int:
        limits = getattr(self.entry, "limits", None)
        return int(getattr(limits, "temporal", 4) or 4)

    async def create(self, http: Request) -> JSONResponse:
        self.sweep_from_now()
        fields, image = await _fields(http)
        model = fields.get("model")
        if model not in (None, "", self.name):
            raise OpenAIError(404, f"model {model!r} is not served here; GET /v1/models lists {self.name!r}",
                              param="model")
        request, size, seconds, fps = job_request(fields, image, self.fps, self.stride(), self.fps_input)
        try:
            checked = await asyncio.to_thread(validate, self.entry, request)
        except Exception as exc:  # the plugin's refusal: a 400 naming its field
            raise openai_error(exc, overload_status=self.overload_status) from None
        job = await asyncio.to_thread(self.store.create, model=self.name, prompt=request["prompt"], size=size,
                                      seconds=seconds, owner=self.runner.group, tenant=tenant(http))
        self.tasks[job["id"]] = asyncio.create_task(self._run(job["id"], checked, fps))
        return JSONResponse(public(job))

    async def _run(self, ident: str, request: Any, fps: float) -> None:
        beat = asyncio.create_task(self._heartbeat(ident))
        try:
            result, progress = None, 0
            async for items in self.runner.stream(request):
                for kind, value in items:
                    if kind == "chunk":  # a chunk that names no step (the decode's) keeps the progress
                        progress = max(progress, _progress(value, progress))
                        await asyncio.to_thread(self.store.update, ident, status="in_progress", progress=progress)
                    elif kind == "end":
                        result = value
                    elif kind == "error":
                        raise value
                if await asyncio.to_thread(self.store.cancel_requested, ident):
                    return  # leaving the stream cancels it on every rank
            if result is None:
                raise RuntimeError("the stream ended without a result")
            video = result["video"]
            mp4, png = await asyncio.to_thread(lambda: (mp4_bytes(video, fps, self.crf), thumbnail_png(video)))
            await asyncio.to_thread(self.store.finish, ident, mp4, png)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the job failed: the reason is its own (never another job's payload)
            failure = classify(exc, overload_status=self.overload_status, rejected_status=400)
            await asyncio.to_thread(self.store.fail, ident, failure.kind, failure.message)
        finally:
            beat.cancel()
            self.tasks.pop(ident, None)

    async def _heartbeat(self, ident: str) -> None:
        """Touch the job while it runs (queued jobs get no chunks), and stop it when another group's
        DELETE left its flag."""
        while True:
            await asyncio.sleep(self.store.stale_s / HEARTBEATS)
            if await asyncio.to_thread(self.store.cancel_requested, ident):
                task = self.tasks.get(ident)
                if task is not None:
                    task.cancel()
                return
            await asyncio.to_thread(self.store.update, ident)

    async def find(self, ident: str, http: Request) -> dict[str, Any]:
        """The caller's job `ident` (another tenant's is not found: a 404, as if it never existed)."""
        self.sweep_from_now()
        job = await asyncio.to_thread(self.store.get, ident)
        if job is None or job.get("tenant") != tenant(http):
            raise _not_found(ident)
        return job

    async def delete(self, ident: str, http: Request) -> JSONResponse:
        await self.find(ident, http)
        job = await asyncio.to_thread(self.store.request_cancel, ident)
        if job is None:
            raise _not_found(ident)
        task = self.tasks.get(ident)
        if task is not None and job["status"] not in FINISHED:
            task.cancel()
        return JSONResponse({"id": ident, "object": "video.deleted", "deleted": True})


def _progress(chunk: Any, last: int) -> int:
    """0-99 while denoising ({"step": i, "of": n} after step i); 100 only once the video is stored; `last`
    for a chunk that names no step, so a poll never reads less than the one before."""
    try:
        return max(0, min(99, int(99 * int(chunk["step"]) / max(int(chunk["of"]), 1))))
    except (TypeError, KeyError, ValueError):
        return last


async def _fields(http: Request) -> tuple[dict[str, Any], np.ndarray | None]:
    media = http.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "multipart/form-data":
        form = await http.form()
        fields, image = {}, None
        for key, value in form.multi_items():
            if hasattr(value, "read"):  # an uploaded file
                if key != "input_reference":
                    raise OpenAIError(400, f"only input_reference may be a file; got a file for {key!r}", param=key)
                image = image_of(await value.read())
            else:
                fields[key] = value
        return fields, image
    try:
        body = await http.json()
    except ValueError:
        raise OpenAIError(400, "the body is not JSON (or a multipart form)") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return body, reference_image(body.get("input_reference"))


def tenant(http: Request) -> str | None:
    """The caller's tenant, as the edge guard found it from the API key (None on a server without keys)."""
    return getattr(http.state, "tenant", None)


def _not_found(ident: str) -> OpenAIError:
    return OpenAIError(404, f"no video {ident!r} here (never created, deleted, or expired)", param="video_id")


def add_video_routes(api: FastAPI, runner: Any, options: Any) -> VideoJobs:
    """Mount the Videos API on `api` (see the module docstring)."""
    jobs = VideoJobs(runner, options)
    wait = {"openai-poll-after-ms": POLL_AFTER_MS}

    async def create_video(http: Request) -> Response:
        try:
            return await jobs.create(http)
        except OpenAIError as error:
            return error.response()

    async def retrieve_video(video_id: str, http: Request) -> Response:
        try:
            job = await jobs.find(video_id, http)
        except OpenAIError as error:
            return error.response()
        return JSONResponse(public(job), headers=None if job["status"] in FINISHED else wait)

    async def video_content(video_id: str, http: Request, variant: str = "video") -> Response:
        if variant not in ("video", "thumbnail"):
            return OpenAIError(400, f"variant {variant!r} is not served; use 'video' or 'thumbnail'",
                               param="variant").response()
        try:
            job = await jobs.find(video_id, http)
        except OpenAIError as error:
            return error.response()
        data = await asyncio.to_thread(jobs.store.content, video_id, variant)
        if job["status"] != "completed" or data is None:
            return OpenAIError(409, f"video {video_id!r} is {job['status']}; its content exists once it is "
                               "completed", param="video_id").response()
        return Response(data, media_type="video/mp4" if variant == "video" else "image/png")

    async def delete_video(video_id: str, http: Request) -> Response:
        try:
            return await jobs.delete(video_id, http)
        except OpenAIError as error:
            return error.response()

    async def remix_video(video_id: str, http: Request) -> Response:
        try:
            await jobs.find(video_id, http)
        except OpenAIError as error:
            return error.response()
        return OpenAIError(400, f"remix is not offered by this server: the plugin makes a video from a prompt "
                           f"(and an input_reference image), not from another video; create a new video with the "
                           f"prompt you want (video {video_id!r} is left as it is)", param="video_id").response()

    async def list_videos(http: Request, limit: int = 20, after: str | None = None, order: str = "desc") -> Response:
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            return OpenAIError(400, f"limit must lie in [1, 100] and order be 'asc' or 'desc'; got {limit}, "
                               f"{order!r}", param="limit" if not 1 <= limit <= 100 else "order").response()
        jobs.sweep_from_now()
        page, more = await asyncio.to_thread(jobs.store.list, limit=limit, after=after, order=order,
                                             tenant=tenant(http))
        data = [public(job) for job in page]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": more})

    tags, errors = ["openai"], {400: {"description": "a bad field (param names it)"},
                                404: {"description": "no such video"}}
    api.add_api_route("/v1/videos", create_video, methods=["POST"], tags=tags, responses=errors,
                      summary="Create a video job (OpenAI-compatible; JSON or multipart form)",
                      openapi_extra={"requestBody": {"required": True, "content": {
                          "application/json": {"schema": CREATE_SCHEMA},
                          "multipart/form-data": {"schema": {**CREATE_SCHEMA, "properties": {
                              **CREATE_SCHEMA["properties"], "input_reference": {"type": "string",
                                                                                 "format": "binary"}}}}}}})
    api.add_api_route("/v1/videos", list_videos, methods=["GET"], tags=tags, responses={400: errors[400]},
                      summary="List video jobs, newest first")
    api.add_api_route("/v1/videos/{video_id}", retrieve_video, methods=["GET"], tags=tags, responses=errors,
                      summary="A video job's status and progress")
    api.add_api_route("/v1/videos/{video_id}", delete_video, methods=["DELETE"], tags=tags, responses=errors,
                      summary="Delete a video job (a running one is cancelled)")
    api.add_api_route("/v1/videos/{video_id}/content", video_content, methods=["GET"], tags=tags,
                      responses={**errors, 409: {"description": "the video is not completed"},
                                 200: {"content": {"video/mp4": {}, "image/png": {}}}},
                      summary="The MP4 (or variant=thumbnail: a PNG of the first frame)")
    api.add_api_route("/v1/videos/{video_id}/remix", remix_video, methods=["POST"], tags=tags, responses=errors,
                      summary="Not offered: always a 400 naming why (404 for an unknown video)")
    return jobs
