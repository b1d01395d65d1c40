"""FLUX.1-Kontext: engine edits equal diffusers' FluxKontextPipeline on the tiny checkpoint
(guidance-embedded, as FLUX.1-Kontext-dev), alone and step-batched (requests joining mid-run,
true CFG and plain, n > 1, two source-image sizes), and text-to-image without a source image.

For CPU time the source image is resized to a small list of "preferred" resolutions here (the
adapter's `resolutions` and the reference module's PREFERRED_KONTEXT_RESOLUTIONS; diffusers'
own list is about 1 MP each), and diffusers' `max_area` is the requested area, which keeps the
requested size (the adapter serves exactly the requested size).

Tolerances: the final packed latents within 1e-4 (max abs, fp32) and the decoded image within a
mean absolute pixel difference of 1.0 (0-255). Another source image moves this tiny model's
latents by ~4e-3, so the latent check sees a dropped or misplaced condition image.
"""

from __future__ import annotations

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
from vllm_omni_plugin.diffusion.adapters.flux_kontext import FluxKontextAdapter
from vllm_omni_plugin.diffusion.errors import RequestValidationError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

SIZE = 64
RESOLUTIONS = ((64, 64), (96, 48), (48, 96))  # (width, height), as diffusers' list
TOLERANCE = 1.0  # pixels
LATENT_TOLERANCE = 1e-4


class SmallKontextAdapter(FluxKontextAdapter):
    resolutions = RESOLUTIONS


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("flux-kontext")


@pytest.fixture(scope="module")
def engine(model_dir):
    return latent_keeping_engine(SmallKontextAdapter, model_dir)


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import FluxKontextPipeline
    from diffusers.pipelines.flux import pipeline_flux_kontext as module

    p = reference_pipeline(FluxKontextPipeline, model_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "PREFERRED_KONTEXT_RESOLUTIONS", list(RESOLUTIONS))
        yield p


def reference(pipe, r: GenerationRequest):
    """diffusers' packed final latents and PIL images for the same request and seed."""
    return run_keeping_last_latents(
        pipe,
        r.input_images[0] if r.input_images else None,
        r.prompt,
        negative_prompt=r.negative_prompt,
        true_cfg_scale=r.knobs.get("true_cfg_scale", 1.0),
        guidance_scale=r.guidance_scale,
        height=SIZE,
        width=SIZE,
        max_area=SIZE * SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
    )


def req(rid, prompt, image, seed, steps=2, negative=None, n=1, cfg=None, guidance=3.5):
    return square_request(
        rid,
        prompt,
        SIZE,
        seed,
        steps,
        negative_prompt=negative,
        n=n,
        guidance_scale=guidance,
        input_images=[] if image is None else [image],
        knobs={} if cfg is None else {"true_cfg_scale": cfg},
    )


def test_alone_matches_diffusers(engine, pipe, pixel_diff):
    r = req("alone", "make it red", noise_image(0), seed=7, negative="blurry", cfg=2.0)  # true CFG
    (out,) = engine.generate([r])
    assert out.error is None, out.error
    assert out.images[0].size == (SIZE, SIZE)
    latents, images = reference(pipe, r)
    assert latent_diff(engine, r, latents) <= LATENT_TOLERANCE
    assert pixel_diff(out.images[0], images[0]) <= TOLERANCE


def test_batched_with_joins_matches_diffusers(engine, pipe, staggered):
    first = [  # fresh together; source images 64x48 -> 64x64 and 32x64 -> 48x96 here
        req("b0", "a red cube", noise_image(1), seed=1, steps=3),
        req("b1", "a cat", noise_image(2, size=(32, 64)), seed=2, negative="blurry", cfg=3.0),
    ]
    later = [
        req("b3", "a photo of a cube", noise_image(1), seed=4, n=2, guidance=5.0),
        req("b4", "red", None, seed=5),  # no source image: FLUX.1 text-to-image
    ]
    results = staggered(engine, first, later, join_after_steps=1)
    assert max(results[r.request_id].metrics["max_batch"] for r in first + later) >= 3
    check_final_latents(
        engine, results, first + later, lambda r: reference(pipe, r)[0], LATENT_TOLERANCE, SIZE
    )
    # The source image matters: same prompt and seed, another image, other latents.
    other = req("o", "a photo of a cube", noise_image(6), seed=4)
    engine.generate([other])
    assert latent_diff(engine, other, engine.final_latents["b3"][:1]) > 10 * LATENT_TOLERANCE


def test_two_images_or_a_mask_are_refused(engine):
    from vllm_omni_plugin.pipelines import get_pipeline, pipeline_for_class

    # The API server's bound (the topology's) is the engine's: one source image, no mask.
    topology = get_pipeline("flux_kontext")
    assert pipeline_for_class("FluxKontextPipeline") is topology
    assert (topology.max_input_images, topology.requires_input_image) == (1, False)
    assert FluxKontextAdapter.max_input_images == 1 and not topology.accepts_mask
    for bad in (
        GenerationRequest("two", "x", input_images=[noise_image(0), noise_image(1)]),
        GenerationRequest("m", "x", input_images=[noise_image(0)], mask=Image.new("L", (64, 48))),
    ):
        with pytest.raises(RequestValidationError) as info:
            engine.validate(bad)
        assert info.value.field == ("mask" if bad.mask is not None else "image")
