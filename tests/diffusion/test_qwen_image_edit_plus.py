"""Qwen-Image-Edit-2509 / 2511: engine edits with several source images equal diffusers'
QwenImageEditPlusPipeline on the tiny checkpoints, alone and step-batched (requests joining
mid-run, true CFG and plain, n > 1, one and two source images of different sizes).

For CPU time both of diffusers' image areas are 64x64 pixels here (CONDITION_IMAGE_SIZE, what
the text encoder sees, 384x384 in diffusers; VAE_IMAGE_SIZE, what the transformer sees,
1024x1024): the adapter's `condition_pixels` / `vae_pixels` and the reference module's
constants. tests/serving/test_edit_families_serve.py checks the default areas against an
unmodified reference.

Tolerances: the final packed latents within 1e-4 (max abs, fp32) and the decoded image within a
mean absolute pixel difference of 1.0 (0-255). Leaving out or swapping a source image moves the
latents by far more (checked below), so the latent check sees every image.
"""

from __future__ import annotations

import dataclasses

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

from vllm_omni_plugin.diffusion import GenerationRequest, qwen_image_rows
from vllm_omni_plugin.diffusion.adapters.qwen_image_edit import load_processor
from vllm_omni_plugin.diffusion.adapters.qwen_image_edit_plus import QwenImageEditPlusAdapter
from vllm_omni_plugin.diffusion.errors import RequestValidationError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

SIZE = 64
AREA = 64 * 64
TOLERANCE = 1.0  # pixels
LATENT_TOLERANCE = 1e-4


class SmallAreaAdapter(QwenImageEditPlusAdapter):
    condition_pixels = AREA
    vae_pixels = AREA


def make_engine(model_dir):
    return latent_keeping_engine(SmallAreaAdapter, model_dir)


def make_pipe(model_dir, monkeypatch):
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    p = reference_pipeline(
        QwenImageEditPlusPipeline, model_dir, processor=load_processor(model_dir / "processor")
    )
    monkeypatch.setattr(module, "CONDITION_IMAGE_SIZE", AREA)
    monkeypatch.setattr(module, "VAE_IMAGE_SIZE", AREA)
    return p


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen-image-edit-plus")


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def pipe(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        yield make_pipe(model_dir, mp)


def reference(pipe, r: GenerationRequest):
    """diffusers' packed final latents and PIL images for the same request and seed."""
    return run_keeping_last_latents(
        pipe,
        list(r.input_images),
        r.prompt,
        negative_prompt=r.negative_prompt,
        true_cfg_scale=r.knobs.get("true_cfg_scale", 4.0),  # diffusers' default, and ours
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
    )


def req(rid, prompt, images, seed, steps=2, negative=None, n=1):
    return square_request(
        rid, prompt, SIZE, seed, steps, negative_prompt=negative, n=n, input_images=list(images)
    )


def test_two_images_alone_match_diffusers(engine, pipe, pixel_diff):
    r = req(
        "alone",
        "the cat on the cube",
        [noise_image(0), noise_image(1, (32, 64))],
        7,
        negative="blurry",
    )
    (out,) = engine.generate([r])
    assert out.error is None, out.error
    assert out.images[0].size == (SIZE, SIZE)
    latents, images = reference(pipe, r)
    assert latent_diff(engine, r, latents) <= LATENT_TOLERANCE
    assert pixel_diff(out.images[0], images[0]) <= TOLERANCE
    # Every image counts, in order: the first alone, or the two swapped, move the latents.
    for rid, images in (("first", r.input_images[:1]), ("swap", r.input_images[::-1])):
        other = dataclasses.replace(r, request_id=rid, input_images=images)
        engine.generate([other])
        moved = latent_diff(engine, other, engine.final_latents["alone"])
        assert moved > 10 * LATENT_TOLERANCE, rid


def ran_per_row(engine, before: dict) -> None:
    """The batch's prompts of different lengths took the per-row attention
    (qwen_image_rows.py), never its masked fallback."""
    after = qwen_image_rows.counts(engine.adapter.pipe.transformer)
    assert after["per_row"] > before["per_row"]
    assert after["masked"] == before["masked"]


def test_batched_with_joins_matches_diffusers(engine, pipe, staggered):
    two = [noise_image(2), noise_image(3)]
    first = [
        req("b0", "make it red", two, seed=1, steps=3),
        req("b1", "sky", [noise_image(4, (64, 32))], seed=2, negative="blurry"),  # CFG, one image
    ]
    later = [req("b2", "turn the cube into a cat", two, seed=3, n=2)]  # joins b0's batch
    before = qwen_image_rows.counts(engine.adapter.pipe.transformer)
    results = staggered(engine, first, later, join_after_steps=1)
    ran_per_row(engine, before)
    assert max(results[r.request_id].metrics["max_batch"] for r in first + later) >= 3
    check_final_latents(
        engine, results, first + later, lambda r: reference(pipe, r)[0], LATENT_TOLERANCE, SIZE
    )


def test_2511_zero_cond_t_batched_matches_diffusers(tmp_path, staggered):
    """Qwen-Image-Edit-2511's transformer (zero_cond_t) through the same adapter, batched."""
    from vllm_omni_plugin.testing.tiny_qwen_image_edit_plus import build_2511

    model_dir = build_2511(tmp_path / "2511", seed=0)
    engine = make_engine(model_dir)
    assert engine.adapter.pipe.transformer.config.zero_cond_t
    two = [noise_image(5), noise_image(6, (48, 64))]
    first = [req("z0", "make it blue", two, seed=1, steps=3, negative="blurry")]
    later = [req("z1", "a red cube", two, seed=2, negative="dark")]
    before = qwen_image_rows.counts(engine.adapter.pipe.transformer)
    results = staggered(engine, first, later, join_after_steps=1)
    ran_per_row(engine, before)
    assert max(o.metrics["max_batch"] for o in results.values()) >= 2
    with pytest.MonkeyPatch.context() as mp:
        pipe = make_pipe(model_dir, mp)
        for r in first + later:
            assert results[r.request_id].error is None
            assert latent_diff(engine, r, reference(pipe, r)[0]) <= LATENT_TOLERANCE, r.request_id


def test_more_images_than_the_model_takes_or_a_mask_are_refused(engine):
    from vllm_omni_plugin.pipelines import get_pipeline, pipeline_for_class

    # The API server's bound (the topology's) is the engine's: 1 to 4 source images, no mask.
    topology = get_pipeline("qwen_image_edit_plus")
    assert pipeline_for_class("QwenImageEditPlusPipeline") is topology
    assert (topology.max_input_images, topology.requires_input_image) == (4, True)
    assert QwenImageEditPlusAdapter.max_input_images == 4 and not topology.accepts_mask
    five = [noise_image(i) for i in range(5)]
    for bad, field in (
        (GenerationRequest("none", "x"), "image"),
        (GenerationRequest("five", "x", input_images=five), "image"),
        (GenerationRequest("m", "x", input_images=five[:1], mask=Image.new("L", (64, 48))), "mask"),
    ):
        with pytest.raises(RequestValidationError) as info:
            engine.validate(bad)
        assert info.value.field == field
    engine.validate(GenerationRequest("four", "x", input_images=five[:4]))
