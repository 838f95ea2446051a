"""GPU smoke check: NCCL groups over every visible GPU, CUDA tensors back to the caller, GPU weight sync.

Run on a machine with CUDA GPUs: `.venv/bin/python benchmarks/gpu_smoke.py`
1. one replica with NCCL groups over every visible GPU: the TP result equals a CPU reference and
   arrives as a CUDA tensor on the output rank's device (CUDA IPC over the same-node request lane);
   every rank sees every GPU and binds its own (`cuda:k` is the same GPU in every process); a CUDA
   request tensor reaches every rank as the caller's `cuda:0` tensor;
2. RL weight sync on GPU: `cuda_ipc` (trainer and rank on GPU 0) and, with 2+ GPUs, `nccl` (rank on
   GPU 1); the rank's output equals the trainer's module; `sleep(level=2)` frees the rank's weight
   memory and a weight update refills it.
4. a robot policy: pi0.5's real config with random bf16 weights (`check_policy`): its chunk against the same
   weights in float32, a lone frame's latency, 16 robots per expert step against one at a time.
5. an LLM: Qwen3-1.7B's real config with random bf16 weights (`check_llm`): 64 one-prompt requests of
   32 tokens through hf_causal_lm against transformers' one padded `generate` batch, tokens/s of
   both, the engine's peak memory, and how many first tokens agree.
3. a world model: Wan2.1-T2V-1.3B's config with random bf16 weights at 480 x 832 x 33 frames, the
   engine's step time and peak memory against WanPipeline's, and 4 concurrent requests against its
   4-prompt call (`check_world_model`).
Exits 0 when every check passes; exits 2 (and says so) when no GPU is visible. `--dry-run`: every
part at a tiny size on CPU (no GPU needed; the suite runs it).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       Entry, P, ParallelConfig)


class RowParallelMatmul:
    """y = x @ W.T with W's input columns split over dense_tp; partial products all-reduced over NCCL."""

    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        full = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
        n, g = ctx.group_size("dense_tp"), ctx.group_rank("dense_tp")
        self.cols = slice(g * 4096 // n, (g + 1) * 4096 // n)
        self.weight = full[:, self.cols].to(ctx.device)
        self.device = ctx.device

    def step(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.device)[:, self.cols] @ self.weight.T
        return P.all_reduce(y, group="dense_tp")

    def visibility(self) -> tuple[str | None, int, int]:
        """(CUDA_VISIBLE_DEVICES, current device, device count) as this rank sees them."""
        import os

        return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.current_device(), torch.cuda.device_count()

    def echo(self, x: torch.Tensor) -> tuple[str, float]:
        """Where a CUDA request tensor arrived, and its sum."""
        return str(x.device), float(x.sum())

    def device_name(self) -> str:
        return f"{self.device} {torch.cuda.get_device_name(self.device)} backend={torch.distributed.get_backend()}"


class SmokeEntry(Entry):
    name = "gpu_smoke"
    parallel_domains = frozenset({"dense"})

    def create(self, plugin_args: dict, ctx: Any) -> RowParallelMatmul:
        return RowParallelMatmul(plugin_args, ctx)


def main() -> int:
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("gpu_smoke: no CUDA GPU visible; nothing to check")
        return 2
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=gpus)) if gpus > 1 else ParallelConfig()
    args = EngineArgs(plugin=SmokeEntry, config=EngineConfig(device=DeviceConfig(target="cuda"), parallel=parallel))
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(1))
    expected = x @ torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0)).T
    start = time.perf_counter()
    with Engine(args, DeploymentConfig.local(devices=tuple(range(gpus)))) as engine:
        print(f"startup {time.perf_counter() - start:.1f}s, mode={engine.mode}, tp={gpus}")
        print("ranks:", engine.collective_rpc("device_name", replica=0, all_ranks=True))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            y = engine.step(x)
            times.append(time.perf_counter() - t0)
        print(f"result on {y.device}, dtype {y.dtype}, shape {tuple(y.shape)}")
        error = (y.cpu() - expected).abs().max().item() / expected.abs().max().item()
        transport = engine._executors[0].transport
        seen = engine.collective_rpc("visibility", replica=0, all_ranks=True)
        x_gpu = x.cuda(0)
        echoed = engine.collective_rpc("echo", x_gpu, replica=0, all_ranks=True)
        visible_ok = [(current, count) for _, current, count in seen] == [(r, gpus) for r in range(gpus)]
        echo_ok = all(d == "cuda:0" and abs(total - float(x_gpu.sum())) < 1e-2 for d, total in echoed)
        print(f"transport {transport}; ranks see {seen}: {'OK' if visible_ok else 'FAILED'} (each rank sees every GPU "
              f"and binds its own); a cuda:0 request arrives as {echoed}: {'OK' if echo_ok else 'FAILED'}")
        times.sort()
        print(f"step latency median {times[len(times) // 2] * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms; "
              f"relative error vs CPU reference {error:.2e}")
    ok = y.is_cuda and y.device == torch.device("cuda", 0) and error < 1e-3 and visible_ok and echo_ok
    ok = ok and transport == "ipc"
    ok = check_weight_sync("cuda_ipc", device=0) and ok
    if gpus > 1:
        ok = check_weight_sync("nccl", device=1) and ok
    ok = check_world_model() and ok
    ok = check_policy() and ok
    ok = check_llm() and ok
    print("gpu_smoke:", "OK" if ok else "FAILED")
    return 0 if ok else 1


class CudaPolicy(torch.nn.Module):
    """A plain nn.Module on the rank's GPU: the default sleep / wake / load_weights hooks apply."""

    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1024, 1024).to(ctx.device)

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(self.linear.weight.device))

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()


class PolicyEntry(Entry):
    name = "gpu_smoke_policy"

    def create(self, plugin_args: dict, ctx: Any) -> CudaPolicy:
        return CudaPolicy(plugin_args, ctx)


def check_weight_sync(backend: str, device: int) -> bool:
    """Sleep level 2, sync new weights with `backend` from this process (on GPU 0), wake, compare."""
    from phyai_ray import WeightSender

    trainer = torch.nn.Linear(1024, 1024).cuda(0)
    x = torch.randn(8, 1024, device="cuda:0")
    args = EngineArgs(plugin=PolicyEntry, config=EngineConfig(device=DeviceConfig(target="cuda")))
    with Engine(args, DeploymentConfig.local(devices=(device,))) as engine:
        before = engine.collective_rpc("allocated", replica=0)
        engine.sleep(level=2)
        asleep = engine.collective_rpc("allocated", replica=0)
        sender = WeightSender(backend)
        sender.init_transfer(engine)
        params = [(f"linear.{k}", v) for k, v in trainer.state_dict().items()]
        reports = sender.update(engine, params, version=1)
        engine.wake_up()
        y = engine.step(x)
        with torch.no_grad():
            error = (y.to("cuda:0") - trainer(x)).abs().max().item()
    ok = asleep < before and all(r.error is None for r in reports) and error < 1e-5
    print(f"weight sync {backend} (rank on GPU {device}): allocated {before} -> asleep {asleep} bytes, "
          f"max error {error:.2e}, reports {[r.state for r in reports]}: {'OK' if ok else 'FAILED'}")
    return ok


# -- world model: Wan2.1-T2V-1.3B at a real size, against diffusers' own pipeline ----------------------------
WAN_1_3B = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
            "rope_max_seq_len": 1024}  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
WORLD_REAL = {"height": 480, "width": 832, "num_frames": 33, "num_inference_steps": 4, "guidance_scale": 5.0,
              "max_sequence_length": 512}
WORLD_DRY = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 3, "guidance_scale": 5.0,
             "max_sequence_length": 16}


def real_config(component: str, name: str = "Wan2.1-T2V-1.3B") -> dict[str, Any] | None:
    """`component`'s config.json committed under tests/data/real_configs/<name>/ (None when absent),
    without diffusers' "_" keys."""
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "tests" / "data" / "real_configs" / name / component
    files = sorted(folder.glob("*config.json")) if folder.is_dir() else []
    if not files:
        return None
    return {k: v for k, v in json.loads(files[0].read_text()).items() if not k.startswith("_")}


def world_folder(root: Any, dry_run: bool) -> Any:
    """A WanPipeline folder: dry run the tiny test folder; else Wan2.1-T2V-1.3B's transformer, VAE and
    scheduler configs (tests/data/real_configs/, else the published numbers) with random weights, the
    transformer in bf16, and a 2-layer text encoder of UMT5-XXL's width (one call per request, not per
    step: its depth does not change what is measured)."""
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])  # the tests' folder builders, run from anywhere
    if repo not in sys.path:
        sys.path.insert(0, repo)
    folder = Path(root) / "wan"
    if dry_run:
        from tests.diffusers_folders import build_wan

        return build_wan(folder)
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.diffusers_folders import _tokenizer

    tokenizer = _tokenizer()
    with torch.device("cuda"):
        transformer = WanTransformer3DModel(**(real_config("transformer") or WAN_1_3B)).to(torch.bfloat16)
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=4096, d_kv=64, d_ff=10240,
                                                   num_layers=2, num_heads=64, feed_forward_proj="gated-gelu",
                                                   pad_token_id=0, eos_token_id=1)).to(torch.bfloat16)
        vae = AutoencoderKLWan(**(real_config("vae") or {}))
    scheduler = UniPCMultistepScheduler(**(real_config("scheduler") or {"prediction_type": "flow_prediction",
                                                                         "use_flow_sigmas": True, "flow_shift": 3.0}))
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                transformer=transformer).save_pretrained(folder)
    del transformer, text_encoder, vae
    torch.cuda.empty_cache()
    return folder


def _step_gaps(times: list[float]) -> float:
    """The median time between consecutive steps."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] if gaps else float("nan")


def _diffusers_call(pipe: Any, shape: dict[str, Any], prompts: list[str]) -> tuple[torch.Tensor, list[float]]:
    """diffusers' own call for `prompts` (seeds 0..n-1): its latents and when each step ended."""
    times: list[float] = []

    def stamp(pipe: Any, i: int, t: Any, kwargs: dict) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter())
        return kwargs

    with torch.no_grad():
        out = pipe(prompt=prompts, negative_prompt=["blurry"] * len(prompts), output_type="latent",
                   generator=[torch.Generator("cpu").manual_seed(k) for k in range(len(prompts))],
                   callback_on_step_end=stamp, **shape).frames
    return torch.as_tensor(out).float().cpu(), times


def _peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def check_world_model(dry_run: bool = False) -> bool:
    """Wan2.1-T2V-1.3B (random bf16 weights, VAE fp32) at 480 x 832 x 33 frames on CUDA: the engine's step
    time and peak memory against WanPipeline's own, its latents against the pipeline's, and 4 concurrent
    requests against the pipeline's one 4-prompt call. `dry_run`: the same path on CPU at 32 x 32 x 9
    frames with the tiny test folder (the suite runs it: tests/test_diffusers_stages.py)."""
    import tempfile

    from diffusers import AutoencoderKLWan, WanPipeline

    device, shape = ("cpu", WORLD_DRY) if dry_run else ("cuda", WORLD_REAL)
    prompts = [f"a robot arm picks up the red cube {k}" for k in range(4)]
    requests = [{**shape, "prompt": p, "negative_prompt": "blurry", "seed": k, "output_type": "latent"}
                for k, p in enumerate(prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = world_folder(tmp, dry_run)
        dtype = torch.float32 if dry_run else torch.bfloat16
        pipe = WanPipeline.from_pretrained(folder, torch_dtype=dtype,
                                           vae=AutoencoderKLWan.from_pretrained(folder / "vae")).to(device)
        pipe.set_progress_bar_config(disable=True)
        _diffusers_call(pipe, {**shape, "num_inference_steps": 1}, prompts[:1])  # warm-up
        _peak_reset()
        want, times = _diffusers_call(pipe, shape, prompts[:1])
        ref = {"step_s": _step_gaps(times), "peak_gib": _peak_gib()}
        start = time.perf_counter()
        batch, _ = _diffusers_call(pipe, shape, prompts)
        ref["batch_s"] = time.perf_counter() - start
        del pipe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        args = EngineArgs(plugin="phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry",
                          plugin_args={"model": str(folder), "max_latent_tokens_per_step": 1 << 30},
                          config=EngineConfig(device=DeviceConfig(target=device)))
        with Engine(args) as engine:
            engine.step({**requests[0], "num_inference_steps": 1})  # warm-up
            _peak_reset()
            stamps = [time.perf_counter() for _ in engine.stream(requests[0], timeout=1800)]
            got = engine.step(requests[0], timeout=1800)["video"].float()
            ours = {"step_s": _step_gaps(stamps[:-1]), "peak_gib": _peak_gib()}
            start = time.perf_counter()
            futures = [engine.submit(r) for r in requests]
            [f.result(timeout=1800) for f in futures]
            ours["batch_s"] = time.perf_counter() - start
    error = float((got - want[0]).abs().max() / want[0].abs().max())
    ratio = ref["batch_s"] / ours["batch_s"]
    label = "dry run (CPU, tiny)" if dry_run else f"{torch.cuda.get_device_name(0)}, bf16"
    print(f"world model, {label}, {shape['num_frames']}x{shape['height']}x{shape['width']}: step "
          f"{ours['step_s'] * 1e3:.1f} ms vs diffusers {ref['step_s'] * 1e3:.1f} ms; peak "
          f"{ours['peak_gib']:.2f} GiB vs {ref['peak_gib']:.2f} GiB; 4 concurrent requests {ours['batch_s']:.2f}s vs "
          f"diffusers' 4-prompt call {ref['batch_s']:.2f}s ({ratio:.2f}x); latents vs diffusers: relative "
          f"max error {error:.1e}")
    return error < (1e-4 if dry_run else 5e-2)


# -- robot policy: pi0.5's real config, random bf16 weights, a lone frame and 16 robots per expert step -------
def policy_rank(root: Any, dry_run: bool, dtype: str | None = None, weights: dict | None = None) -> Any:
    """A `lerobot_policy` rank of pi0.5 (the real variants: PaliGemma 2B, Gemma 300M expert, SigLIP so400m, 224 x
    224 cameras, chunk 50 x 32; dry run: the tests' tiny pi0.5) with random weights (or `weights`), built
    without writing model.safetensors; bf16 on CUDA by default."""
    import json
    import shutil
    from pathlib import Path
    from types import SimpleNamespace

    from phyai_ray.models.lerobot_policy.folder import PolicyFolder
    from phyai_ray.models.lerobot_policy.policy import LeRobotPolicy, build_network

    data = Path(__file__).resolve().parents[1] / "tests" / "data" / "lerobot" / "pi05"
    folder = Path(root) / "pi05"
    if not folder.exists():
        shutil.copytree(data / "pretrained_model", folder)
        config = json.loads((folder / "config.json").read_text())
        if not dry_run:
            config.update(chunk_size=50, max_state_dim=32, max_action_dim=32, image_resolution=[224, 224],
                          tokenizer_max_length=200, num_inference_steps=10)
        (folder / "config.json").write_text(json.dumps(config))
    args = {"model": str(folder), "tokenizer": str(data / "backbone")}
    if dry_run:
        args["sizes"] = json.loads((data / "cases.json").read_text())["sizes"]
    opened = PolicyFolder.open(args)
    device = "cpu" if dry_run else "cuda"
    if weights is None:
        torch.manual_seed(0)
        weights = build_network(opened, device).state_dict()
    opened.load_weights = lambda prefix="": weights  # the random weights, as model.safetensors would give them
    return LeRobotPolicy(opened, SimpleNamespace(device=device), dtype=dtype), weights


def _policy_frame(r: int, size: int) -> dict:
    gen = torch.Generator().manual_seed(r)
    image = lambda: (torch.rand(size, size, 3, generator=gen) * 255).to(torch.uint8)  # noqa: E731
    return {"observation.state": torch.randn(6, generator=gen), "task": f"pick up the red cube {r}",
            "observation.images.top": image(), "observation.images.wrist": image()}


def _timed(fn: Any) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def check_policy(dry_run: bool = False) -> bool:
    """pi0.5 at its real size in bf16 on CUDA (dry run: tiny, float32 on CPU, where bf16 matmuls are slow; the
    suite checks bf16 on CPU in tests/test_lerobot_policy_memory.py): the chunk against the same weights in
    float32 (bf16 tolerance), a lone frame's latency, and 16 robots batched per expert step (chunks/s, p99
    of a batch's latency) against the same 16 frames one at a time, and against LeRobot's
    predict_action_chunk when LeRobot is installed (it is not in this project's venv)."""
    import statistics
    import tempfile

    from phyai_ray.models.lerobot_policy.request import frame_layout
    from phyai_ray.stepwise.frames import parse_frame

    rounds, robots = (1, 4) if dry_run else (5, 16)  # the dry run checks the path, cheaply
    with tempfile.TemporaryDirectory() as tmp:
        rank, weights = policy_rank(tmp, dry_run)  # the default dtype: bf16 on CUDA, float32 on CPU
        layout = frame_layout(rank.folder, None)
        size = 32 if dry_run else 224
        frames = [parse_frame(_policy_frame(r, size), layout) for r in range(robots)]
        got = want = rank.step(frames[0])["actions"]
        if rank.dtype != torch.float32:  # the same weights in float32: what bf16 changes
            reference, _ = policy_rank(tmp, dry_run, dtype="float32", weights=weights)
            want = reference.step(frames[0])["actions"]
            del reference
        del weights
        error = float((got - want).abs().max() / want.abs().max())
        rank.step(frames[1])  # warm
        lone = [_timed(lambda: rank.step(frames[0])) for _ in range(rounds)]

        def batch() -> None:
            for i, f in enumerate(frames):
                rank.admit(i, f)
            while len(rank.running):
                rank.iterate()

        batch()  # warm
        batched = [_timed(batch) for _ in range(rounds)]
        one_at_a_time = _timed(lambda: [rank.step(f) for f in frames])
    chunks_s = robots / statistics.median(batched)
    p99 = sorted(batched)[min(len(batched) - 1, int(0.99 * len(batched)))]
    label = f"dry run (CPU, tiny, {rank.dtype})" if dry_run else \
        f"{torch.cuda.get_device_name(0)}, {rank.dtype}"
    print(f"policy pi0.5, {label}: chunk vs float32 relative max error {error:.1e}; lone frame "
          f"{statistics.median(lone) * 1e3:.1f} ms; {robots} robots per expert step {chunks_s:.1f} chunks/s "
          f"(a batch p50 {statistics.median(batched) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms) vs one at a time "
          f"{robots / one_at_a_time:.1f} chunks/s ({chunks_s * one_at_a_time / robots:.2f}x); LeRobot's "
          f"predict_action_chunk: {_lerobot_note()}")
    return bool(torch.isfinite(got).all()) and got.shape == want.shape and error < 5e-2


def _lerobot_note() -> str:
    try:
        import lerobot  # noqa: F401
    except ImportError:
        return ("not installed here (scripts/lerobot_reference/build_venv.sh builds its venv; "
                "bench_policy.py compares)")
    return "installed, not compared by this check (bench_policy.py does)"


QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
LLM_DRY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)


def check_llm(dry_run: bool = False) -> bool:
    """hf_causal_lm on Qwen3-1.7B's config (random bf16 weights) against transformers' batched generate:
    64 one-prompt requests of 32 tokens. `dry_run`: a tiny float32 Qwen3 on CPU, 8 requests of 4 tokens."""
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM, Qwen3Config

    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.bfloat16)
    count, tokens = (8, 4) if dry_run else (64, 32)
    shape = LLM_DRY if dry_run else QWEN3_1_7B
    prompts = [[(31 * i + 7 * j + 1) % shape["vocab_size"] for j in range(8 + i % 17)] for i in range(count)]
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        reference = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=dtype)
        reference.save_pretrained(tmp)
        reference = reference.to(device).eval()
        args = EngineArgs(plugin="hf_causal_lm", plugin_args={"model": tmp, "max_model_len": 512},
                          config=EngineConfig(device=DeviceConfig(target=device)))
        _peak_reset()
        with Engine(args) as engine:
            engine.step({"prompts": prompts[:2], "max_tokens": 2})  # warm-up
            start = time.perf_counter()
            futures = [engine.submit({"prompts": [p], "max_tokens": tokens, "ignore_eos": True}) for p in prompts]
            ours = [f.result(timeout=600)[0].token_ids for f in futures]
            ours_s = time.perf_counter() - start
        peak = _peak_gib()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        start = time.perf_counter()
        with torch.no_grad():
            theirs = reference.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                        do_sample=False, pad_token_id=0, eos_token_id=None)[:, width:].tolist()
        theirs_s = time.perf_counter() - start
    agree = sum(a[0] == b[0] for a, b in zip(ours, theirs))
    label = "dry run (CPU, tiny, fp32)" if dry_run else f"{torch.cuda.get_device_name(0)}, Qwen3-1.7B config, bf16"
    print(f"llm hf_causal_lm, {label}: {count} one-prompt requests x {tokens} tokens: {count * tokens / ours_s:.0f} "
          f"tok/s, transformers one padded batch {count * tokens / theirs_s:.0f} tok/s, ratio {theirs_s / ours_s:.2f}x; "
          f"peak memory {peak:.2f} GiB; first tokens equal {agree}/{count}")
    full = all(len(t) == tokens for t in ours)
    return full and agree >= (count if dry_run else int(0.9 * count))


def dry_run() -> int:
    """Every part at a tiny size on CPU (the suite runs this; no GPU needed): 0 when each passes."""
    ok = check_world_model(dry_run=True)
    ok = check_policy(dry_run=True) and ok
    ok = check_llm(dry_run=True) and ok
    print("gpu_smoke --dry-run:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(dry_run() if "--dry-run" in sys.argv[1:] else main())
