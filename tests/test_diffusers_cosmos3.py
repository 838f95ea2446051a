"""Cosmos3 omni in `diffusers_pipeline`: the family's packed step loop against diffusers' own pipeline.

    .venv/bin/python -m pytest tests/test_diffusers_cosmos3.py -q

A tiny random folder (tests/cosmos3_folders.py) is loaded twice: as diffusers' `Cosmos3OmniPipeline`
(the reference, called with generator=torch.Generator("cpu").manual_seed(seed) in this process under
torch.no_grad()) and as `Cosmos3Family` over its own copy of the components. The loop here is the
per-rank model's: `start` per request, `step` over every running request at once (one packed forward
per guidance branch, the text's keys and values computed in the first only), `decode` and `outputs`
at the end. One request alone equals the pipeline to
1e-6 (video, action chunk, sound); requests of every mode, prompt length, frame count, guidance and
step count packed into the same forwards equal it to 1e-5. Tensor parallel 2 and CFG over 2 run as two
ranks in two threads of this process, their collectives (nn.linear's row-parallel sum, the CFG
gather) exchanged through a barrier (`ThreadRanks`), each rank equal to the pipeline to 1e-5. Then
the same through the Entry and the per-rank model inline, and the layouts refused before any rank
starts.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import threading  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from tests.cosmos3_folders import build_cosmos3, load_cosmos3_pipeline  # noqa: E402
from tests.tolerances import Tolerance, against

RNG = np.random.default_rng(11)
IMAGE = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
CLIP = RNG.integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)
DROID = RNG.normal(size=(3, 10)).astype(np.float32)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_cosmos3(tmp_path_factory.mktemp("cosmos3") / "pipeline")


@pytest.fixture(scope="module")
def pipe(folder):
    return load_cosmos3_pipeline(folder)


def new_family(folder, cfg_rank: int = 0, cfg_size: int = 1, ctx=None):
    """A Cosmos3Family over its own copy of the folder's modules (it installs its attention on them)."""
    import json

    from phyai_ray.models.diffusers_pipeline.cosmos3 import Cosmos3Family
    from phyai_ray.models.diffusers_pipeline.family import Branches

    own = load_cosmos3_pipeline(folder)
    parts = {name: getattr(own, name) for name in ("transformer", "text_tokenizer", "vae", "scheduler",
                                                  "sound_tokenizer")}
    index = json.loads((folder / "model_index.json").read_text())
    family = Cosmos3Family(parts, index, Branches(cfg_rank, cfg_size), "cpu", torch.float32)
    if ctx is not None:
        family.parallelize(ctx)
    return family


@pytest.fixture(scope="module")
def family(folder):
    return new_family(folder)


def request(**fields) -> dict:
    r = dict(prompt="a robot arm picks up the red cube", negative_prompt=None, num_frames=9, height=64, width=64,
             fps=24.0, num_inference_steps=3, guidance_scale=6.0, seed=0, enable_sound=False, output_type="float",
             image=None, video=None, action=None)
    r.update(fields)
    return r


def action(mode: str, **fields) -> dict:
    out = dict(mode=mode, chunk_size=4, domain_name="droid_lerobot", resolution_tier=256, view_point="ego_view",
               raw_actions=DROID if mode == "forward_dynamics" else None)
    return request(action=out, num_frames=None, height=None, width=None,
                   **({"video": CLIP} if mode == "inverse_dynamics" else {"image": IMAGE}), **fields)


def reference(pipe, r: dict) -> dict:
    """Cosmos3OmniPipeline for the same request: {"video": float [F, H, W, 3], "action"?, "sound"?}."""
    from diffusers import CosmosActionCondition
    from PIL import Image

    kwargs: dict = {}
    video = None if r["video"] is None else [Image.fromarray(frame) for frame in r["video"]]
    if r["action"] is not None:
        a = r["action"]
        raw = None if a["raw_actions"] is None else torch.as_tensor(a["raw_actions"])
        kwargs["action"] = CosmosActionCondition(mode=a["mode"], chunk_size=a["chunk_size"],
                                                 domain_name=a["domain_name"], resolution_tier=a["resolution_tier"],
                                                 raw_actions=raw, image=r["image"], video=video,
                                                 view_point=a["view_point"])
    else:
        kwargs.update(num_frames=r["num_frames"], height=r["height"], width=r["width"], image=r["image"], video=video)
    with torch.no_grad():
        out = pipe(r["prompt"], negative_prompt=r["negative_prompt"], fps=r["fps"],
                   num_inference_steps=r["num_inference_steps"], guidance_scale=r["guidance_scale"],
                   enable_sound=r["enable_sound"], generator=torch.Generator("cpu").manual_seed(r["seed"]),
                   output_type="np", **kwargs)
    want = {"video": torch.from_numpy(out.video)}
    if out.action is not None:
        want["action"] = out.action[0]
    if out.sound is not None:
        want["sound"] = out.sound
    return want


def run(family, requests: list[dict]) -> list[dict]:
    """The per-rank loop over `requests` admitted together: every unfinished job steps in each family.step."""
    jobs = [family.start(r) for r in requests]
    family.join(jobs)
    while not all(job.done for job in jobs):
        family.step([job for job in jobs if not job.done])
    return [{"video": family.decode(job), **family.outputs(job)} for job in jobs]


def assert_equal(got: dict, want: dict, tol: Tolerance) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key].float(), **tol, msg=key)


def test_text_to_video_with_sound_alone_equals_the_pipeline(family, pipe):
    r = request(enable_sound=True)
    text = []  # the text tokens each forward carries: the prompt's only in the first step (then cached)
    hook = family.transformer.register_forward_pre_hook(lambda m, a, kw: text.append(kw["und_len"]), with_kwargs=True)
    try:
        [got] = run(family, [r])
    finally:
        hook.remove()
    assert min(text[:2]) > 0 and text[2:] == [0] * 4  # cond and uncond, 3 steps
    assert got["video"].shape == (9, 64, 64, 3) and got["sound"].shape[0] == 2
    assert_equal(got, reference(pipe, r), tol=against("diffusers", "alone"))


def test_policy_alone_equals_the_pipeline_video_and_action_chunk(family, pipe):
    r = action("policy", seed=4)
    [got] = run(family, [r])
    assert got["action"].shape == (4, 10)  # chunk_size x DROID's raw action width
    assert_equal(got, reference(pipe, r), tol=against("diffusers", "alone"))


def test_every_mode_packed_per_step_equals_each_alone(family, pipe):
    requests = [request(num_inference_steps=4),
                request(prompt="a dog runs", num_frames=5, seed=3, enable_sound=True),  # shorter prompt and clip
                request(image=IMAGE, seed=7, guidance_scale=1.0, num_inference_steps=2),  # image-to-world, no CFG
                request(video=CLIP, seed=8, height=32, num_inference_steps=2),  # video-to-world
                action("policy", seed=5), action("forward_dynamics", seed=6, num_inference_steps=2),
                action("inverse_dynamics", seed=9, guidance_scale=1.0)]
    for r, got in zip(requests, run(family, requests)):
        assert_equal(got, reference(pipe, r), tol=against("diffusers", "batched"))


class ThreadRanks:
    """Two ranks as two threads: `all_reduce` sums and `all_gather` stacks their tensors in rank order."""

    def __init__(self, size: int = 2) -> None:
        self.size, self.barrier, self.local = size, threading.Barrier(size), threading.local()
        self.slots: list = [None] * size

    def _exchange(self, x: torch.Tensor) -> list:
        self.slots[self.local.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts

    def all_reduce(self, x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
        parts = self._exchange(x)
        return x.copy_(parts[0] + parts[1])

    def all_gather(self, x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)

    def run(self, work) -> list:
        out, errors = [None] * self.size, []

        def rank(r: int) -> None:
            self.local.rank = r
            try:
                out[r] = work(r)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


def test_tensor_parallel_2_and_cfg_2_equal_the_pipeline(folder, pipe, monkeypatch):
    import phyai_ray.collectives
    import phyai_ray.nn.linear

    ranks = ThreadRanks()
    monkeypatch.setattr(phyai_ray.nn.linear, "P", ranks)
    monkeypatch.setattr(phyai_ray.collectives, "P", ranks)
    requests = [request(num_inference_steps=2, seed=21, enable_sound=True),
                action("policy", seed=22, num_inference_steps=2)]
    wants = [reference(pipe, r) for r in requests]
    families = {"tp": [new_family(folder, ctx=SimpleNamespace(group_size=lambda g: 2, group_rank=lambda g, r=r: r))
                       for r in range(2)],
                "cfg": [new_family(folder, cfg_rank=r, cfg_size=2) for r in range(2)]}
    assert families["tp"][1].transformer.layers[0].self_attn.num_key_value_heads == 1  # 2 kv heads over 2 ranks
    for layout, pair in families.items():
        for results in ranks.run(lambda r: run(pair[r], requests)):
            for got, want in zip(results, wants):
                assert_equal(got, want, tol=against("diffusers", "batched"))


def test_the_entry_and_rank_model_serve_it_inline(folder, pipe):
    from phyai_ray import Engine, EngineArgs

    args = EngineArgs(plugin="diffusers_pipeline", plugin_args={"model": str(folder)})
    with Engine(args) as engine:
        policy, video = action("policy", seed=2), request(seed=1, num_inference_steps=2)
        futures = [engine.submit(policy), engine.submit(video)]
        for r, future in zip((policy, video), futures):
            out = future.result(timeout=120)
            want = reference(pipe, r)
            torch.testing.assert_close(out["video"], want["video"], **against("diffusers", "batched"))
            if "action" in want:
                torch.testing.assert_close(out["action"], want["action"], **against("diffusers", "batched"))


def test_requests_the_folder_cannot_serve_are_refused_naming_the_rule(folder):
    from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry
    from phyai_ray.models.diffusers_pipeline.request import VideoRequestError

    entry = DiffusersPipelineEntry({"model": str(folder)})
    cases = [({"num_frames": 8}, "4k\\+1"), ({"height": 40}, "multiples of 16"), ({"steps": 3}, "unknown"),
             ({**action("policy"), "num_frames": 5}, "leave \\['num_frames'\\] unset"),
             ({**action("policy"), "action": {**action("policy")["action"], "domain_name": "libero"}}, "libero"),
             ({**action("forward_dynamics"), "image": IMAGE,
               "action": {**action("forward_dynamics")["action"], "raw_actions": DROID[:, :4]}}, "\\[T >= 1, 10\\]")]
    for fields, rule in cases:
        with pytest.raises(VideoRequestError, match=rule):
            entry.validate_request({**request(), **fields})
    [spec] = entry.sequences(action("policy"))
    assert spec.payload["action"]["mode"] == "policy" and spec.steps == 3
    from phyai_ray.models.diffusers_pipeline.cosmos3_request import FolderLimits, parse

    mute = FolderLimits(temporal=4, spatial=16, patch=2, sound=False, action=False, action_dim=0)
    for fields, rule in [({"enable_sound": True}, "sound_tokenizer"), (action("policy"), "no action head")]:
        with pytest.raises(VideoRequestError, match=rule):
            parse({**request(), **fields}, mute)
    capped = DiffusersPipelineEntry({"model": str(folder), "max_frames": 9, "max_pixels": 64 * 64})
    for fields, rule in [({"num_frames": 13}, "max_frames=9 \\(plugin_args\\['max_frames'\\]"),
                         ({"height": 128}, "max_pixels=4096"), (action("policy"), "81920 pixels per frame")]:
        with pytest.raises(VideoRequestError, match=rule):
            capped.validate_request({**request(), **fields})


def test_the_guardrail_checks_the_prompt_in_the_dispatcher_and_the_video_after_decode(folder, pipe, family):
    import json

    from phyai_ray.errors import GuardrailError
    from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry
    from phyai_ray.models.diffusers_pipeline.guardrail import Guardrail, GuardrailConfigError
    from tests.diffusers_cosmos import STAND_IN

    entry = DiffusersPipelineEntry({"model": str(folder), "safety_checker": STAND_IN})
    with pytest.raises(GuardrailError, match="refused the prompt"):
        entry.validate_request(request(prompt="a forbidden cube"))
    entry.validate_request(request())
    index = folder / "model_index.json"  # a folder that keeps enable_safety_checker needs a checker
    saved = index.read_text()
    try:
        index.write_text(json.dumps({**json.loads(saved), "enable_safety_checker": True}))
        with pytest.raises(GuardrailConfigError, match="safety_checker"):
            DiffusersPipelineEntry({"model": str(folder)})
    finally:
        index.write_text(saved)
    r = request(seed=12, num_inference_steps=2)
    family.components["safety_checker"] = Guardrail.load(STAND_IN)  # the stand-in passes every video through
    try:
        [got] = run(family, [r])
    finally:
        del family.components["safety_checker"]
    frames = (reference(pipe, r)["video"].numpy() * 255).astype(np.uint8)  # the pipeline's uint8 round trip
    torch.testing.assert_close(got["video"], torch.from_numpy(frames.astype(np.float32) / 255.0), **against("diffusers", "alone"))


def test_layouts_other_than_equal_tp_and_cfg_are_refused_before_any_rank(folder):
    from phyai_ray import AttentionParallelConfig, DenseParallelConfig, OuterParallelConfig, ParallelConfig
    from phyai_ray.errors import ParallelConfigError
    from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry

    entry = DiffusersPipelineEntry({"model": str(folder)})
    entry.check_parallel(ParallelConfig(outer=OuterParallelConfig(cfg_size=2)))
    entry.check_parallel(ParallelConfig(attention=AttentionParallelConfig(tp_size=2),
                                        dense=DenseParallelConfig(tp_size=2), outer=OuterParallelConfig(cfg_size=2)))
    refused = [(ParallelConfig(attention=AttentionParallelConfig(cp_size=2)), "attention.cp_size=2"),
               (ParallelConfig(attention=AttentionParallelConfig(tp_size=2)), "unequal tensor parallel"),
               (ParallelConfig(attention=AttentionParallelConfig(tp_size=4), dense=DenseParallelConfig(tp_size=4)),
                "does not divide num_attention_heads=4 and num_key_value_heads=2"),
               (ParallelConfig(outer=OuterParallelConfig(pp_size=2)), "pp")]
    for layout, rule in refused:
        with pytest.raises(ParallelConfigError, match=rule):
            entry.check_parallel(layout)
