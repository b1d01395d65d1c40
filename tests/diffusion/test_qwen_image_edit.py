"""Qwen-Image-Edit: engine images equal diffusers' QwenImageEditPipeline on the tiny checkpoint,
alone and step-batched (requests joining mid-run, CFG and plain, n > 1).

For CPU time the condition area (diffusers' `calculate_dimensions(1024 * 1024, ratio)`) is
64x64 pixels on both sides here: the adapter's `condition_pixels` and the reference module's
`calculate_dimensions` target. tests/serving/test_edits_serve.py checks the default 1 MP area
against an unmodified reference.

Tolerances: the final latents (the denoising state handed to the VAE) within 1e-4 (max abs,
fp32; the source image moves them by ~2e-2 here, so a dropped condition cannot pass), and the
decoded image within a mean absolute pixel difference of 1.0 (0-255). Pixels alone would be a
weak check: the tiny random VAE maps most latent changes to a fraction of a grey level.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from family_helpers import (
    check_final_latents,
    latent_diff,
    latent_keeping_engine,
    noise_image,
    reference_pipeline,
    run_keeping_last_latents,
    seeded,
    square_request,
)
from PIL import Image

from vllm_omni_plugin.diffusion import GenerationRequest
from vllm_omni_plugin.diffusion.adapters.qwen_image_edit import (
    QwenImageEditAdapter,
    load_processor,
)
from vllm_omni_plugin.diffusion.errors import RequestValidationError

SIZE = 64
AREA = 64 * 64
TOLERANCE = 1.0  # pixels
LATENT_TOLERANCE = 1e-4


class SmallConditionAdapter(QwenImageEditAdapter):
    condition_pixels = AREA


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen-image-edit")


@pytest.fixture(scope="module")
def engine(model_dir):
    return latent_keeping_engine(SmallConditionAdapter, model_dir)


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

    p = reference_pipeline(
        QwenImageEditPipeline, model_dir, processor=load_processor(model_dir / "processor")
    )
    original = module.calculate_dimensions
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "calculate_dimensions", lambda _area, ratio: original(AREA, ratio))
        yield p


def reference(pipe, r: GenerationRequest):
    """diffusers' packed final latents and PIL images for the same request and seed."""
    return run_keeping_last_latents(
        pipe,
        r.input_images[0],
        r.prompt,
        negative_prompt=r.negative_prompt,
        true_cfg_scale=r.knobs.get("true_cfg_scale", 4.0),  # diffusers' default, and ours
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
    )


def req(rid, prompt, image, seed, steps=2, negative=None, n=1):
    return square_request(
        rid, prompt, SIZE, seed, steps, negative_prompt=negative, n=n, input_images=[image]
    )


def test_tiny_template_prefix_is_64_tokens_like_the_real_one(pipe):
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    assert len(pipe.tokenizer(prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx


def test_alone_matches_diffusers(engine, pipe, pixel_diff):
    r = req("alone", "make it red", noise_image(0), seed=7, negative="blurry")  # true CFG on
    (out,) = engine.generate([r])
    assert out.error is None, out.error
    assert out.images[0].size == (SIZE, SIZE)
    latents, images = reference(pipe, r)
    assert latent_diff(engine, r, latents) <= LATENT_TOLERANCE
    assert pixel_diff(out.images[0], images[0]) <= TOLERANCE


def test_batched_with_joins_matches_diffusers(engine, pipe, pixel_diff, staggered):
    first = [  # fresh together, with different condition sizes (64x64 and 96x32 here)
        req("b0", "turn the cube into a cat", noise_image(1), seed=1, steps=3),
        req("b1", "sky", noise_image(2, size=(64, 32)), seed=2, steps=2),
    ]
    later = [req("b2", "make it blue", noise_image(1), seed=3, steps=2, n=2)]
    results = staggered(engine, first, later, join_after_steps=1)
    assert max(results[r.request_id].metrics["max_batch"] for r in first + later) >= 3
    check_final_latents(
        engine, results, first + later, lambda r: reference(pipe, r)[0], LATENT_TOLERANCE, SIZE
    )
    # The source image matters: same prompt and seed, another image, other latents.
    other = req("o", "make it blue", noise_image(5), seed=3)
    engine.generate([other])
    assert latent_diff(engine, other, engine.final_latents["b2"][:1]) > 100 * LATENT_TOLERANCE


def test_requests_without_one_image_or_with_a_mask_are_refused(engine):
    r = req("none", "x", noise_image(0), seed=0)
    for bad, field in (
        (GenerationRequest("none", "x"), "image"),
        (GenerationRequest("two", "x", input_images=[noise_image(0), noise_image(1)]), "image"),
        (
            GenerationRequest(
                "m", "x", input_images=[noise_image(0)], mask=Image.new("L", (64, 48))
            ),
            "mask",
        ),
    ):
        with pytest.raises(RequestValidationError) as info:
            engine.validate(bad)
        assert info.value.field == field
    engine.validate(r)  # the well-formed one passes


def test_stage_decodes_the_api_servers_png(engine):
    """The contract: GenerationParams carries lossless RGB PNG bytes, decoded to the same pixels."""
    from vllm_omni_plugin.serving.edits import to_rgb_png
    from vllm_omni_plugin.stages.diffusion_stage import _decode_png

    im = noise_image(3)
    back = _decode_png(to_rgb_png(im))
    assert back.mode == "RGB" and (np.asarray(back) == np.asarray(im)).all()
    assert io.BytesIO(to_rgb_png(im)).getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_true_cfg_scale_knob_matches_diffusers(engine, pipe):
    """A request's own `true_cfg_scale`: the same final latents as diffusers given that scale
    (1e-4), other than the default's (4.0)."""
    base = req("knob", "make it red", noise_image(3), seed=11, negative="blurry")
    r = dataclasses.replace(base, knobs={"true_cfg_scale": 2.5})
    (out,) = engine.generate([r])
    assert out.error is None, out.error
    assert latent_diff(engine, r, reference(pipe, r)[0]) <= LATENT_TOLERANCE
    (default,) = engine.generate([dataclasses.replace(r, request_id="knob0", knobs={})])
    assert default.error is None
    assert latent_diff(engine, r, engine.final_latents["knob0"]) > 100 * LATENT_TOLERANCE
