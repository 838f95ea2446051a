"""Cosmos3's encode stage: the conditioning clips of requests admitted together, VAE-encoded in one call.

    .venv/bin/python -m pytest tests/test_diffusers_cosmos3_encode.py -q

Over the tiny random folder of tests/cosmos3_folders.py: `encode_clips` of clips of one shape makes ONE
call of diffusers' VAE encode whose per-clip latents equal each clip encoded alone (the Wan VAE reads
the samples of a batch apart) to float32 rounding, and a clip's first 4k+1 frames give its whole
encode's first k+1 latent frames (the VAE is causal in time); requests of several modes admitted in
one `encode(jobs)` (three policy frames on one tier canvas, two text-to-video requests of one size,
one image-to-world) make one VAE call per clip shape, each clip cut to the frames its conditioning
latents read, and each request's video and action chunk still equal `Cosmos3OmniPipeline`
called for it alone; a request whose encode fails in the batch fails alone through the encode stage
(stages.py encodes the batch again one by one), the others are served.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from tests.test_diffusers_cosmos3 import IMAGE, action, assert_equal, new_family, reference, request  # noqa: E402
from tests.test_diffusers_cosmos3 import folder, pipe  # noqa: E402,F401
from tests.tolerances import against

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def family(folder):
    return new_family(folder)


def vae_batches(family) -> tuple[list[tuple[int, int]], object]:
    """(batch, frames) of every VAE encode call the family makes (its encode wrapped on the instance)."""
    sizes: list[tuple[int, int]] = []
    vae = family.pipe.vae
    original = vae.encode

    def counted(x, *args, **kwargs):
        sizes.append((int(x.shape[0]), int(x.shape[2])))
        return original(x, *args, **kwargs)

    vae.encode = counted
    return sizes, lambda: delattr(vae, "encode")


def loop(family, jobs) -> list[dict]:
    """The per-rank loop over jobs already encoded: every unfinished job steps in each family.step."""
    family.join(jobs)
    while not all(job.done for job in jobs):
        family.step([job for job in jobs if not job.done])
    return [{"video": family.decode(job), **family.outputs(job)} for job in jobs]


def test_clips_of_one_shape_in_one_call_equal_each_encoded_alone(family):
    from phyai_ray.models.diffusers_pipeline.cosmos3 import encode_clips

    gen = torch.Generator("cpu").manual_seed(3)
    clips = [torch.rand(1, 3, 9, 64, 64, generator=gen) * 2 - 1 for _ in range(4)]
    clips.insert(2, torch.rand(1, 3, 5, 32, 64, generator=gen) * 2 - 1)  # another shape, between them
    sizes, restore = vae_batches(family)
    try:
        together = encode_clips(family.pipe, clips)
    finally:
        restore()
    assert sorted(sizes) == [(1, 5), (4, 9)]
    with torch.no_grad():
        alone = [family.pipe._encode_video(clip) for clip in clips]
    for got, want in zip(together, alone):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **against("diffusers", "batched"))  # measured: 1.4e-6 at most, latents of ~1
    with torch.no_grad():
        for frames, latent_frames in ((1, 1), (5, 2)):
            first = family.pipe._encode_video(clips[0][:, :, :frames])
            torch.testing.assert_close(first, alone[0][:, :, :latent_frames], **against("diffusers", "alone"))


def test_requests_admitted_together_share_a_vae_call_per_shape_and_equal_the_pipeline(family, pipe):
    requests = [action("policy", seed=1, num_inference_steps=2), action("policy", seed=2, num_inference_steps=2),
                action("policy", seed=3, prompt="put the cube down", num_inference_steps=2),
                request(seed=4, num_inference_steps=2), request(seed=5, prompt="a dog runs", num_inference_steps=2),
                request(image=IMAGE, seed=6, guidance_scale=1.0, num_inference_steps=2)]
    jobs = [family.begin(r) for r in requests]
    sizes, restore = vae_batches(family)
    try:
        family.encode(jobs)
    finally:
        restore()
    # the policy frames on their canvas, one call; the image-to-world frame; text-to-world reads no latent of its
    # clip (all noise): each clip cut to the frames its conditioning latent frame 0 reads (1 of 9)
    assert sorted(sizes) == [(1, 1), (3, 1)]
    for r, got in zip(requests, loop(family, jobs)):
        assert_equal(got, reference(pipe, r), tol=against("diffusers", "batched"))


def test_a_request_whose_encode_fails_fails_alone(family, pipe):
    from phyai_ray.models.diffusers_pipeline.stages import StageWork

    bad = action("policy", seed=8)
    bad["action"] = {**bad["action"], "domain_name": "no_such_robot"}  # refused by prepare_latents after its encode
    requests = [action("policy", seed=7, num_inference_steps=2), bad, request(seed=9, num_inference_steps=2)]
    jobs = [family.begin(r) for r in requests]
    work = StageWork(family, torch.device("cpu"))
    try:
        failed = work.encoded(jobs, work.start_encode(jobs))
    finally:
        work.close()
    assert list(failed) == [id(jobs[1])]
    assert isinstance(failed[id(jobs[1])], ValueError) and "no_such_robot" in str(failed[id(jobs[1])])
    served = [jobs[0], jobs[2]]
    for r, got in zip((requests[0], requests[2]), loop(family, served)):
        assert_equal(got, reference(pipe, r), tol=against("diffusers", "batched"))
