"""Stages: a rank's per-request work (prompt and conditioning encode, VAE decode) beside its step loop.

    encoder, decoder = Stage("encode", device), Stage("decode", device)
    pending = encoder.submit(family.encode, jobs)   # runs on the stage's thread (and CUDA stream)
    ...                                             # the loop's thread steps the transformer meanwhile
    pending.result()                                # done: the embeddings are ready on the device

A `Stage` is one worker thread, and on CUDA its own stream: the work it is given runs in order, one
piece at a time, under `torch.no_grad`, while the loop's thread (the default stream) runs denoising
steps. Before the work starts, the stage's stream waits for what the caller's stream had queued (the
inputs were made there); the stage's thread then waits for its own kernels, so a finished future's
tensors are complete and the loop never synchronises with the stage's stream. Tensors that cross
streams are marked (`hand_over`) so the caching allocator does not reuse their memory under the
other stream.

`decoder_views(vae, tile_pixels)` gives the decode stage its own views of the VAE: they share every
weight with it but keep their own causal-convolution caches (diffusers' AutoencoderKLWan keeps them on
the module and resets them on every encode and decode), so a VAE decode on the decode stage and a VAE
encode on the encode stage can run at once. The second view decodes tiled (diffusers'
`enable_tiling`): the one for videos of at least `tile_pixels` pixels per frame.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

TILE_PIXELS = 1280 * 720  # the VAE decodes in tiles from 720p frames up (plugin_args "vae_tile_pixels")

class Stage:
    """One worker thread (and CUDA stream) for a rank's per-request work (see the module docstring)."""

    def __init__(self, name: str, device: Any) -> None:
        self.name, self.device = name, torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"phyai-{name}")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.Lock()
        self.busy_s = 0.0  # seconds of work this stage ran (for the loop's records)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) on the stage's thread after what the caller's stream queued so far."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return self._pool.submit(self._run, fn, args, ready)

    def _run(self, fn: Callable[..., Any], args: tuple, ready: Any) -> Any:
        import time

        start = time.perf_counter()
        try:
            with torch.no_grad():
                if self.stream is None:
                    return fn(*args)
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):  # the rank's GPU, not cuda:0
                    self.stream.wait_event(ready)
                    out = fn(*args)
                self.stream.synchronize()  # this thread waits for its kernels; the loop's stream never does
                return out
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - start

    def hand_over(self, value: Any, to_stage: bool) -> None:
        """Mark every tensor in `value` (a tensor, or dicts / lists of them) as used by the other side:
        by the stage's stream (`to_stage`) or by the caller's; nothing to do without CUDA."""
        if self.stream is None:
            return
        stream = self.stream if to_stage else torch.cuda.current_stream(self.device)
        for tensor in _tensors(value):
            if tensor.is_cuda:
                tensor.record_stream(stream)

    def close(self) -> None:
        """Let the thread end once its queued work is done."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def tile_pixels(plugin_args: dict[str, Any]) -> int:
    """plugin_args["vae_tile_pixels"]: the pixels per frame (height x width) from which the VAE decodes in
    tiles, default 1280 x 720; 0: never."""
    value = plugin_args.get("vae_tile_pixels", TILE_PIXELS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"plugin_args['vae_tile_pixels'] = {value!r}: give the pixels per frame (an int >= 0) from "
                         f"which the VAE decodes in tiles, e.g. {TILE_PIXELS} (1280 x 720), or 0 for never")
    return value


def decoder_views(vae: Any, tile_pixels: int | None) -> tuple[Any, Any]:
    """(plain, tiled): two views of `vae` that share its weights and keep caches of their own; `tiled`
    decodes in spatial tiles (None when `tile_pixels` is None or 0: never tiled)."""
    plain = copy.copy(vae)  # a new module object over the same submodules and parameters
    if not tile_pixels or not callable(getattr(vae, "enable_tiling", None)):
        return plain, None
    tiled = copy.copy(vae)
    tiled.enable_tiling()
    return plain, tiled


# -- the stages of one rank's running jobs -------------------------------------------------------------------
IDLE_WAIT_S = 0.05  # an iteration with nothing to step waits this long at most for a decode to finish
STAGE_WAIT_S = 600.0  # the longest the loop waits for an encode, or a sleep for the decodes in flight


def own_failure(exc: BaseException, stage: str) -> BaseException:
    """What a request's own stage failure fails it with: out of device memory becomes an
    OutOfMemoryRequestError (503, it may fit later); anything else stays itself."""
    if isinstance(exc, torch.OutOfMemoryError):
        from phyai_ray.errors import OutOfMemoryRequestError

        error = OutOfMemoryRequestError(f"the {stage} stage of this request ran out of device memory ({exc}); "
                                        "send it again later, or with fewer frames or a lower resolution")
        error.__cause__ = exc
        return error
    return exc


@dataclass
class PendingDecode:
    """A job whose latents are final and whose video the decode stage makes: `base` is its result so far
    (steps, weight version, "output_type")."""

    job: Any
    base: dict[str, Any]


def video_result(base: dict[str, Any], video: torch.Tensor) -> dict[str, Any]:
    """A request's result from `base` (its steps, weight version, "output_type") and its decoded float
    video: the video as it asked, float [F, H, W, 3] in [0, 1] ("float") or uint8."""
    out = {k: v for k, v in base.items() if k != "output_type"}
    out["video"] = video if base["output_type"] == "float" else (video * 255).round().to(torch.uint8)
    return out


class StageWork:
    """The encode and decode stages of one rank's jobs, for the model's loop (model.py).

    Encode: the jobs admitted in one plan are encoded together on the encode stage while the loop's
    thread steps the jobs already running; the iteration then waits for that encode, and the new jobs
    take their first step in it. On a replica of several ranks only the encoding rank starts it; the
    model then sends its outcome to the other ranks (encode_rank.py), so ranks agree which jobs step.
    A job whose encode fails is reported alone (`failed`).
    Decode: only on the output rank (the others' results are not read), on the decode stage; the job
    left the denoising set at its last step, and a later iteration returns its video (`finished`).
    `log` records (what, ident, thread, start, end) of every decode and every iteration, for tests and
    benchmarks (the last 4,096)."""

    def __init__(self, family: Any, device: Any) -> None:
        from collections import deque

        self.family = family
        self.encoder, self.decoder = Stage("encode", device), Stage("decode", device)
        self.decoding: dict[int, tuple[Future, dict[str, Any]]] = {}
        self.log: Any = deque(maxlen=4096)

    # -- encode --------------------------------------------------------------------------------
    def start_encode(self, jobs: list[Any]) -> Future:
        """The encode of the jobs admitted together, on the encode stage; its result: {id(job): error}
        of the jobs that failed (the batch failed: each is then encoded alone to find which)."""
        return self.encoder.submit(self._encode, jobs)

    def _encode(self, jobs: list[Any]) -> dict[int, BaseException]:
        try:
            self.family.encode(jobs)
            return {}
        except Exception:  # noqa: BLE001 - one request's input or memory: find whose, encode the rest
            if len(jobs) == 1:
                raise
        failed: dict[int, BaseException] = {}
        for job in jobs:
            try:
                self.family.encode([job])
            except Exception as exc:  # noqa: BLE001 - that request's own failure
                failed[id(job)] = own_failure(exc, "encode")
        return failed

    def encoded(self, jobs: list[Any], pending: Future) -> dict[int, BaseException]:
        """Wait for the encode of `jobs`; {id(job): error} of the ones that failed (the others are ready)."""
        try:
            failed = pending.result(timeout=STAGE_WAIT_S)
        except TimeoutError:  # a stuck encode stage: these requests fail, the step loop goes on
            error = TimeoutError(f"the encode stage did not finish these {len(jobs)} request(s) in {STAGE_WAIT_S:g} s")
            failed = {id(job): error for job in jobs}
        except Exception as exc:  # noqa: BLE001 - a batch of one: that request's own failure
            failed = {id(jobs[0]): own_failure(exc, "encode")}
        for job in jobs:
            if id(job) not in failed:
                self.encoder.hand_over(job.cond, to_stage=False)
        return failed

    # -- decode --------------------------------------------------------------------------------
    def start_decode(self, ident: int, job: Any, result: dict[str, Any]) -> None:
        """Decode `job` on the decode stage; `result` gets its video when done (`finished`)."""
        self.decoder.hand_over(job.value, to_stage=True)
        self.decoding[ident] = (self.decoder.submit(self._decode, ident, job), result)

    def _decode(self, ident: int, job: Any) -> torch.Tensor:
        import time

        start = time.perf_counter()
        try:
            return self.family.decode(job).cpu()
        finally:
            self.log.append(("decode", ident, threading.current_thread().name, start, time.perf_counter()))

    def finished(self, wait: bool) -> dict[int, Any]:
        """{ident: (result, None) or (None, error)} of the decodes done; with `wait`, after waiting up
        to IDLE_WAIT_S for the first one (an iteration with nothing to step)."""
        if wait and self.decoding:
            from concurrent.futures import FIRST_COMPLETED
            from concurrent.futures import wait as wait_for

            wait_for([f for f, _ in self.decoding.values()], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        out: dict[int, Any] = {}
        for ident, (future, result) in list(self.decoding.items()):
            if not future.done():
                continue
            del self.decoding[ident]
            try:
                video = future.result()
            except Exception as exc:  # noqa: BLE001 - that request's own decode (or its guardrail)
                out[ident] = (None, own_failure(exc, "decode"))
                continue
            out[ident] = (video_result(result, video), None)
        return out

    def drain(self) -> None:
        """Wait for every decode in flight (before the weights move: sleep); their results stay to be
        returned by the next iterations."""
        from concurrent.futures import wait as wait_for

        _, stuck = wait_for([future for future, _ in self.decoding.values()], timeout=STAGE_WAIT_S)
        if stuck:
            raise TimeoutError(f"{len(stuck)} decode(s) still running after {STAGE_WAIT_S:g} s; the weights were "
                               "not moved")

    def forget(self, ident: int) -> None:
        """A dropped request: its decode's result, when it comes, is not returned."""
        self.decoding.pop(ident, None)

    def close(self) -> None:
        self.encoder.close()
        self.decoder.close()
