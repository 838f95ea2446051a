"""openpi's robot-policy WebSocket on every group's edge: `WS /v1/openpi`.

    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    policy = WebsocketClientPolicy(host="ws://127.0.0.1:8000/v1/openpi", api_key=KEY)
    policy.get_server_metadata()                 # the plugin's Entry.policy_metadata()
    actions = policy.infer({"state": state})["actions"]

The protocol, as openpi's policy server speaks it: the client connects (`Authorization: Api-Key
<key>`; `Bearer <key>` works too), the server sends its metadata frame, then every binary frame
from the client is one observation (msgpack, NumPy arrays as `{__ndarray__, data, dtype, shape}`)
and gets one binary reply: the plugin's result dict plus `server_timing` (`queue_ms`, `infer_ms`,
`batch_size`, `deadline_ms`, `deadline_met`, `total_ms`, `weight_version`, `group`, `forwarded`,
`request_id`, and `received_at` / `sent_at` in Unix seconds: a client discards a chunk that is
stale by them).
An error is a text frame.

Deadlines: `deadline_ms` in the connection URL's query (`ws://host/v1/openpi?deadline_ms=100`) is
every frame's default; `deadline_ms` in an observation is that frame's (it is not passed to the
policy). A frame is scheduled earliest deadline first, and one whose deadline passes before it
starts, or that cannot finish by it, is answered at once with a "deadline_missed" error frame; the
session goes on. `late` (query or frame: "finish" or "drop") says what a frame whose chunk is ready
only after its deadline gets: the late chunk, or (fail closed) that error frame instead.

One connection is one session on ONE replica group: Serve's proxy hands the connection to one
group's Serve replica, and every frame of it runs on that group (batched with other robots'
frames when batching is on). When that group fails, the robot's next (or in-flight) frame gets
an error frame and the connection closes (code 1011); the robot connects again. Serve's routers
learn that a group failed from its routing stats (up to `request_routing_stats_period_s`, 2 s,
later), so a reconnect may still land on the failed group: a session that opens on a group that
has already failed has every frame forwarded to a healthy group (`GroupRunner.run`'s failover,
`server_timing.forwarded` true), so the robot's first frame after a reconnect gets a chunk at
once. A frame the plugin rejects gets an error frame and the session goes on. An idle session
closes after `IDLE_TIMEOUT_S` (code 1000), so no wait lasts forever.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Any

import msgpack
import numpy as np
import torch
from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.serve.protocols.error_map import classify, describe
from phyai_ray.serve.protocols.guard import key_matches
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.serve.runtime.runner import GroupRunner
from phyai_ray.serve.protocols.timing import deadline_ms, freshness, late_mode, timing_fields
from phyai_ray.validation import validate

logger = logging.getLogger(__name__)

ROUTE = "/v1/openpi"
IDLE_TIMEOUT_S = 600.0
DTYPE_KINDS = frozenset("biuf")  # bool, signed, unsigned, float: never objects, never pickle
INLINE_CODEC_BYTES = 64 * 1024  # smaller frames are decoded and encoded on the event loop (microseconds)


class FrameError(ValueError):
    """An observation frame that cannot be decoded; the message names the field and the values."""


def unpack(frame: bytes, max_bytes: int) -> Any:
    """One msgpack observation -> dict with CPU tensors for the NumPy arrays (checked before building)."""
    budget = [max_bytes]

    def hook(obj: dict) -> Any:
        if b"__ndarray__" in obj:
            return _array(obj, budget)
        if b"__npgeneric__" in obj:
            return _scalar(obj)
        return obj

    try:
        return msgpack.unpackb(frame, object_hook=hook, strict_map_key=False)
    except FrameError:
        raise
    except Exception as exc:  # msgpack's own errors: ExtraData, FormatError, ValueError, ...
        raise FrameError(f"the frame is not a msgpack observation: {type(exc).__name__}: {exc}") from None


def _dtype(name: Any) -> np.dtype:
    try:
        dtype = np.dtype(name.decode() if isinstance(name, bytes) else str(name))
    except TypeError:
        raise FrameError(f"unknown dtype {name!r}") from None
    if dtype.kind not in DTYPE_KINDS:
        raise FrameError(f"dtype {dtype.str} is not supported; send bool, int, uint or float arrays")
    return dtype


def _array(obj: dict, budget: list[int]) -> torch.Tensor:
    dtype, shape, data = _dtype(obj.get(b"dtype")), obj.get(b"shape"), obj.get(b"data")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise FrameError(f"array shape {shape!r} must be a list of ints >= 0")
    expected = math.prod(shape) * dtype.itemsize
    if not isinstance(data, bytes) or len(data) != expected:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise FrameError(f"array of shape {list(shape)} and dtype {dtype.str} needs {expected} bytes, got {got}")
    budget[0] -= expected
    if budget[0] < 0:
        raise FrameError("the frame's arrays pass the server's --max-tensor-bytes; send less")
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), copy=True))


def _scalar(obj: dict) -> Any:
    _dtype(obj.get(b"dtype"))
    return obj.get(b"data")


def pack(obj: Any) -> bytes:
    """A reply frame: tensors and NumPy arrays as openpi's msgpack arrays."""
    def default(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu").contiguous()
            value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
        if isinstance(value, np.ndarray) and value.dtype.kind in DTYPE_KINDS:
            return {b"__ndarray__": True, b"data": value.tobytes(), b"dtype": value.dtype.str, b"shape": value.shape}
        if isinstance(value, np.generic):
            return {b"__npgeneric__": True, b"data": value.item(), b"dtype": value.dtype.str}
        raise TypeError(f"a {type(value).__name__} cannot be sent in a reply frame")

    return msgpack.packb(obj, default=default)


def authorized(websocket: WebSocket, api_key: str | dict[str, str] | None) -> bool:
    """`Authorization: Api-Key <key>` (openpi's form) or `Bearer <key>`; always True without a key."""
    return key_matches(websocket.headers.get("authorization"), api_key, ("api-key", "bearer"))


def add_openpi_route(api: FastAPI, runner: GroupRunner, options: ServeOptions) -> None:
    """Register `WS /v1/openpi`: one session per connection, on this group."""

    @api.websocket(ROUTE)
    async def openpi(websocket: WebSocket) -> None:
        if not authorized(websocket, options.key_table()):
            await websocket.close(code=1008, reason="missing or wrong API key; Authorization: Api-Key <key>")
            return
        try:
            default_deadline = deadline_ms(websocket.query_params.get("deadline_ms"), "deadline_ms (the URL's query)")
            default_late = late_mode(websocket.query_params.get("late"), "late (the URL's query)")
        except ValueError as exc:  # accepted first, so the client reads why
            await websocket.accept()
            await websocket.close(code=1008, reason=str(exc)[:120])
            return
        await websocket.accept()
        session = websocket.headers.get("x-request-id") or uuid.uuid4().hex
        logger.info("openpi session %s opened on group %s", session, runner.group)
        try:
            with runner.session():  # open as long as the connection: the group's count, as the router's
                await websocket.send_bytes(pack(runner.entry.policy_metadata()))
                forward = not runner.engine.healthy  # landed on a failed group: a robot reconnecting too soon
                await _serve_frames(websocket, runner, options, session, (default_deadline, default_late), forward)
        except WebSocketDisconnect:
            pass
        finally:
            logger.info("openpi session %s on group %s ended", session, runner.group)


async def _serve_frames(websocket: WebSocket, runner: GroupRunner, options: ServeOptions, session: str,
                        defaults: tuple[float | None, str | None], forward: bool = False) -> None:
    frames = 0
    while True:
        try:
            message = await asyncio.wait_for(websocket.receive(), IDLE_TIMEOUT_S)
        except asyncio.TimeoutError:
            await websocket.close(code=1000, reason=f"idle for {IDLE_TIMEOUT_S:.0f}s")
            return
        if message["type"] == "websocket.disconnect":
            return
        frames += 1
        rid = f"{session}-{frames}"
        reply, fatal = await _answer(message.get("bytes"), runner, options, rid, defaults, forward)
        if isinstance(reply, str):
            logger.warning("openpi frame %s: %s", rid, reply)
            await websocket.send_text(reply)
            if fatal:
                await websocket.close(code=1011, reason="the replica group failed; connect again")
                return
        else:
            await websocket.send_bytes(reply)


async def _off_loop(size: int, work: Any, *args: Any) -> Any:
    """`work(*args)` on a worker thread for a large frame, inline for a small one (a thread hop costs more)."""
    return work(*args) if size < INLINE_CODEC_BYTES else await asyncio.to_thread(work, *args)


async def _answer(frame: bytes | None, runner: GroupRunner, options: ServeOptions, rid: str,
                  defaults: tuple[float | None, str | None] = (None, None),
                  forward: bool = False) -> tuple[Any, bool]:
    """(reply frame, False), or (error text, whether the session must end). `defaults`: the connection's
    (deadline_s, late), from its URL's query; a frame's own `deadline_ms` / `late` fields win.
    `forward`: the session opened on a failed group; its frames run on a healthy one."""
    start, received_at = time.perf_counter(), time.time()
    if frame is None:
        return "expected a binary msgpack observation frame, got a text frame", False
    try:
        request = await _off_loop(len(frame), unpack, frame, options.max_tensor_bytes)
        if not isinstance(request, dict):
            raise FrameError(f"an observation is a dict, got {type(request).__name__}")
        request = {k.decode() if isinstance(k, bytes) else k: v for k, v in request.items()}
        deadline_s = deadline_ms(request.pop("deadline_ms", None), "the observation's deadline_ms")
        deadline_s = defaults[0] if deadline_s is None else deadline_s
        late = late_mode(request.pop("late", None), "the observation's late") or defaults[1]
    except Exception as exc:
        return f"request {rid}: bad observation: {describe(exc)}", False
    timing: dict[str, Any] = {}
    try:  # validated once, here; the session stays on this group unless it opened on a failed one
        result = await runner.run(validate(runner.entry, request), forward=forward, deadline_s=deadline_s,
                                  timing=timing, late=late)
    except Exception as exc:
        failure = classify(exc, overload_status=options.overload_status)
        if failure.kind == "rejected":  # the plugin refused this frame: the session goes on
            return f"request {rid}: bad observation: {failure.message}", False
        fatal = isinstance(exc, EngineUnavailableError) or not (forward or runner.engine.healthy)
        again = "; connect again to reach a healthy group" if fatal else ""
        return (f"request {rid}: group {runner.group} could not act ({failure.kind}, {failure.status}): "
                f"{failure.message}{again}", fatal)
    reply = dict(result) if isinstance(result, dict) else {"actions": result}
    # the version that computed this chunk (the runner's timing); the replica's current one only without it
    forwarded = forward and not timing  # ran on another group: this group's state says nothing of it
    version = timing["weight_version"] if "weight_version" in timing else \
        None if forwarded else runner.engine.replica_status()[0].weight_version
    reply["server_timing"] = {**timing_fields(timing, deadline_s), "total_ms": (time.perf_counter() - start) * 1e3,
                              "weight_version": version, "group": runner.group, "forwarded": forwarded,
                              "request_id": rid, **freshness(received_at)}
    try:
        return await _off_loop(len(frame), pack, reply), False
    except TypeError as exc:
        return f"request {rid}: the policy's result cannot be sent: {exc}", False
