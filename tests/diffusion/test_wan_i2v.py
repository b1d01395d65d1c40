"""Wan2.2 image-to-video: engine frames equal diffusers' on the tiny checkpoints, with requests
batched step by step and joining at different steps, with and without CFG.

- TI2V-5B (`make-tiny-model wan-ti2v`: WanPipeline with expand_timesteps, one expert, the
  Wan2.2 VAE): a request with a source image equals diffusers' WanImageToVideoPipeline loaded
  from the same folder (the image as the first latent frame), one without equals WanPipeline;
  both kinds share forwards.
- I2V-A14B (`make-tiny-model wan-i2v`: WanImageToVideoPipeline, two experts, 36 input
  channels): every request carries its image; both experts run.

diffusers' WanImageToVideoPipeline cleans prompts with ftfy without checking that it is installed
(WanPipeline checks); the references get their prompt embeddings from WanPipeline's
`_get_t5_prompt_embeds`, the same UMT5 code the engine runs.

Tolerance: at most 1/255 per pixel (uint8 frames) and a mean under 0.05/255. Seen here: 0.0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_helpers import (
    check_video,
    noise_picture,
    reference_pipeline,
    seeded,
    square_request,
    tiny_engine,
    video,
)
from PIL import Image

from vllm_omni_plugin.diffusion import GenerationRequest
from vllm_omni_plugin.diffusion.errors import RequestValidationError

FRAMES = 5
MAX_PIXEL_DIFF = 1.0
MAX_MEAN_DIFF = 0.05


def source(seed: int, size=(40, 24)) -> Image.Image:
    """A noise image of another size and aspect ratio than the video (the pipeline resizes)."""
    return noise_picture(seed, *size)


def req(rid, prompt, seed, size, steps=4, guidance=5.0, image=None, **kw):
    return square_request(
        rid,
        prompt,
        size,
        seed,
        steps,
        guidance_scale=guidance,
        num_frames=FRAMES,
        input_images=[] if image is None else [image],
        **kw,
    )


def _embeds(pipe, text: str) -> torch.Tensor:
    from diffusers import WanPipeline

    return WanPipeline._get_t5_prompt_embeds(
        pipe, [text], max_sequence_length=512, device=torch.device("cpu")
    )


def reference(model_dir, r: GenerationRequest) -> np.ndarray:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    common = dict(
        height=r.height,
        width=r.width,
        num_frames=r.num_frames,
        num_inference_steps=r.num_inference_steps,
        guidance_scale=r.guidance_scale,
        generator=seeded(r.seed),
        output_type="pil",
    )
    if not r.input_images:
        pipe = _pipe(WanPipeline, model_dir)
        return video(pipe(r.prompt, negative_prompt=r.negative_prompt, **common).frames[0])
    pipe = _pipe(WanImageToVideoPipeline, model_dir)
    neg = _embeds(pipe, r.negative_prompt or "") if r.guidance_scale > 1 else None
    out = pipe(
        image=r.input_images[0],
        prompt_embeds=_embeds(pipe, r.prompt),
        negative_prompt_embeds=neg,
        **common,
    )
    return video(out.frames[0])


_PIPES: dict = {}


def _pipe(cls, model_dir):
    key = (cls.__name__, str(model_dir))
    if key not in _PIPES:
        _PIPES[key] = reference_pipeline(cls, model_dir)
    return _PIPES[key]


def check_equal(model_dir, requests, out):
    for r in requests:
        o = out[r.request_id]
        assert o.ok, o.error
        got = video(o.images)
        assert got.shape == (FRAMES, r.height, r.width, 3)
        check_video(got, reference(model_dir, r), r.request_id, MAX_PIXEL_DIFF, MAX_MEAN_DIFF)


@pytest.fixture(scope="module")
def ti2v(tiny_models):
    return tiny_models("wan-ti2v")


@pytest.fixture(scope="module")
def i2v(tiny_models):
    return tiny_models("wan-i2v")


def test_ti2v_image_and_text_requests_share_steps_and_equal_diffusers(ti2v, staggered):
    engine = tiny_engine(ti2v)
    assert engine.adapter.max_input_images == 1 and not engine.adapter.requires_input_image
    first = [req("a", "a red cat", 1, 32, image=source(0))]
    later = [
        req("b", "the cube photo", 2, 32),  # text-to-video: joins a's forwards
        req("c", "a cube", 3, 32, guidance=1.0, image=source(1, (32, 32))),  # no CFG
    ]
    out = staggered(engine, first, later, join_after_steps=1)
    assert out["a"].metrics["max_batch"] >= 2 and out["b"].metrics["max_batch"] >= 2
    check_equal(ti2v, [*first, *later], out)
    two = req("two", "a cat", 0, 32, image=source(0))
    two.input_images.append(source(1))
    with pytest.raises(RequestValidationError) as exc:
        engine.validate(two)
    assert exc.value.field == "image"


def test_i2v_two_experts_batched_equal_diffusers(i2v, staggered):
    engine = tiny_engine(i2v)
    timesteps = engine.adapter._timesteps(4)
    assert timesteps[0] >= engine.adapter.boundary > timesteps[-1]  # both experts run
    first = [req("a", "a red cat", 1, 32, image=source(0))]
    later = [req("b", "a cube", 2, 32, image=source(1), negative_prompt="a cat")]
    out = staggered(engine, first, later, join_after_steps=1)
    assert out["b"].metrics["max_batch"] >= 2
    check_equal(i2v, [*first, *later], out)
    with pytest.raises(RequestValidationError) as exc:
        engine.validate(req("no-image", "a cat", 0, 32))
    assert exc.value.field == "image"
