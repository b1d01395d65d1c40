"""Wan2.2 text-to-video: engine frames equal diffusers' WanPipeline on the tiny two-expert
checkpoint (UniPC scheduler, boundary_ratio 0.875), with requests batched step by step,
joining at different steps, with and without CFG.

Tolerance: at most 1/255 per pixel (uint8 frames) and a mean under 0.05/255. Seen here: exactly
equal (0.0), since the rows of a batched forward are computed independently on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from family_helpers import (
    check_video,
    reference_pipeline,
    seeded,
    square_request,
    tiny_engine,
    video,
)

from vllm_omni_plugin.diffusion import GenerationRequest
from vllm_omni_plugin.diffusion.errors import RequestValidationError

SIZE = 32
FRAMES = 9
MAX_PIXEL_DIFF = 1.0
MAX_MEAN_DIFF = 0.05


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("wan")


@pytest.fixture(scope="module")
def engine(model_dir):
    return tiny_engine(model_dir)


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import WanPipeline

    return reference_pipeline(WanPipeline, model_dir)


def req(rid, prompt, seed, steps=6, guidance=5.0, frames=FRAMES, **kw):
    return square_request(
        rid, prompt, SIZE, seed, steps, guidance_scale=guidance, num_frames=frames, **kw
    )


def reference(pipe, r: GenerationRequest) -> np.ndarray:
    frames = pipe(
        r.prompt,
        negative_prompt=r.negative_prompt,
        height=r.height,
        width=r.width,
        num_frames=r.num_frames,
        num_inference_steps=r.num_inference_steps,
        guidance_scale=r.guidance_scale,
        generator=seeded(r.seed),
        output_type="pil",
    ).frames[0]
    return video(frames)


def test_batched_frames_equal_diffusers(engine, pipe, staggered):
    first = [req("a", "a red cat", 1)]
    later = [
        req("b", "the cube photo", 2),  # joins a at its second step (same expert there)
        req("c", "a cube", 3, steps=4, guidance=1.0),  # no CFG: its own group
        req("d", "a red cube", 4, negative_prompt="a cat", frames=5),
    ]
    out = staggered(engine, first, later, join_after_steps=1)
    # Both experts ran: 6 UniPC steps with flow_shift 3 cross t = 875.
    timesteps = engine.adapter._timesteps(6)
    assert timesteps[0] >= engine.adapter.boundary > timesteps[-1]
    assert out["a"].metrics["max_batch"] >= 2 and out["b"].metrics["max_batch"] >= 2
    videos = {}
    for r in [*first, *later]:
        o = out[r.request_id]
        assert o.ok, o.error
        got = video(o.images)
        assert got.shape == (r.num_frames, SIZE, SIZE, 3)
        check_video(got, reference(pipe, r), r.request_id, MAX_PIXEL_DIFF, MAX_MEAN_DIFF)
        videos[r.request_id] = got
    assert np.abs(videos["a"] - videos["b"]).mean() > 1.0  # seeds and prompts matter
    assert np.abs(videos["a"][0] - videos["a"][-1]).mean() > 0.0  # frames are not one image


def test_a_group_decodes_one_video_at_a_time(engine, pipe, staggered):
    """Two requests that finish together decode in one group, one VAE call per video (a
    video's decode is the stage's largest working set); frames as diffusers', within the
    module's tolerance."""
    vae = engine.adapter.pipe.vae
    decode, batches = vae.decode, []

    def counting_decode(z, *args, **kwargs):
        batches.append(z.shape[0])
        return decode(z, *args, **kwargs)

    together = [req("e", "a red cat", 5, steps=2), req("f", "a cube", 6, steps=2)]
    vae.decode = counting_decode
    try:
        out = staggered(engine, together, [], join_after_steps=0)
    finally:
        vae.decode = decode
    assert out["e"].metrics["max_batch"] == 2
    assert batches == [1, 1]
    for r in together:
        assert out[r.request_id].ok, out[r.request_id].error
        want = reference(pipe, r)
        check_video(
            video(out[r.request_id].images), want, r.request_id, MAX_PIXEL_DIFF, MAX_MEAN_DIFF
        )


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"frames": 8}, "num_frames"), ({"frames": 0}, "num_frames"), ({"n": 2}, "n")],
)
def test_bad_video_requests_are_refused(engine, kw, field):
    with pytest.raises(RequestValidationError) as exc:
        engine.validate(req("bad", "a cat", 0, **kw))
    assert exc.value.field == field
