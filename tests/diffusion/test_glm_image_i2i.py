"""GLM-Image DiT stage, image-to-image: engine images equal diffusers' GlmImagePipeline(image=...).

diffusers 0.42.1 cannot run its own image-to-image AR step with transformers 5.19:
`generate_prior_tokens` concatenates the per-image vision features into one tensor before
`get_image_tokens`, which iterates over images, so the VQ model receives 1-channel slices
("expected input[1, 1, 3, 2] to have 32 channels"). The reference is therefore assembled by
hand on the same weights, as the pipeline intends it: transformers' AR (`generate` on the
processor's image + text inputs, the source codes from `get_image_features` +
`get_image_tokens`, both upsampled 2x as diffusers does), then diffusers' own pipeline call with
those ids and the image (its DiT conditions on the source's VAE latents through the
transformer's KV cache). The engine gets only the target prior ids and the source image: it
tokenizes the source itself. Tolerance: mean absolute pixel difference <= 0.1 (0-255).
"""

from __future__ import annotations

import pytest
import torch
from family_helpers import check_images, reference_pipeline, seeded, square_request

from vllm_omni_plugin.diffusion import (
    DiffusionEngine,
    DiffusionEngineConfig,
    GenerationRequest,
    RequestValidationError,
)

SIZE = 64
# Mean absolute pixel difference (0-255) allowed against the reference. Measured here (CPU,
# fp32): 0.0 alone, <= 0.0002 batched. Another source image moves the result by ~0.46.
TOLERANCE = 0.1


def source_image(width: int, height: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr, "RGB")


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("glm-image")


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import GlmImagePipeline

    return reference_pipeline(GlmImagePipeline, model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    return DiffusionEngine(DiffusionEngineConfig(model=str(model_dir)))


@pytest.fixture(scope="module")
def sources():
    # Sides already multiples of 32 inside the tiny processor's bounds: diffusers sees the same
    # pixels the engine's fitting keeps (one portrait, one landscape).
    return [source_image(64, 96, 0), source_image(96, 64, 1)]


def hf_prior(pipe, image, seed: int):
    """transformers' AR on one source image: (target prior ids, [source codes], [source grid]),
    in the shapes diffusers' `generate_prior_tokens` returns them."""
    ar, processor = pipe.vision_language_encoder, pipe.processor
    inputs = processor.apply_chat_template(
        [
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": image},
                        {"type": "text", "text": "make it blue"},
                    ],
                }
            ]
        ],
        tokenize=True,
        target_h=SIZE,
        target_w=SIZE,
        return_dict=True,
        return_tensors="pt",
    )
    rows, cols = SIZE // 32, SIZE // 32
    torch.manual_seed(seed)
    with torch.no_grad():
        out = ar.generate(**inputs, max_new_tokens=rows * cols + 1, do_sample=True)
        target = out[0, inputs["input_ids"].shape[1] :][: rows * cols]
        grid = inputs["image_grid_thw"][:1]
        feats = ar.model.get_image_features(inputs["pixel_values"], grid).pooler_output
        codes = ar.model.get_image_tokens(feats)
    up = pipe._upsample_token_ids
    source = up(codes, int(grid[0, 1]), int(grid[0, 2]))[0]
    big = grid.clone()
    big[:, 1:] *= 2
    return up(target, rows, cols), [source], [big]


@pytest.fixture(scope="module")
def priors(pipe, sources):
    return [hf_prior(pipe, img, i) for i, img in enumerate(sources)]


def edit(priors, sources, rid, prompt, k, seed, steps=2, guidance=1.5, n=1):
    return square_request(
        rid,
        prompt,
        SIZE,
        seed,
        steps,
        n=n,
        guidance_scale=guidance,
        prior_token_ids=priors[k][0],
        input_images=[sources[k]],
    )


def reference(pipe, priors, sources, r: GenerationRequest, k: int | None):
    extra = {}
    if k is not None:
        ids, img_ids, grids = priors[k]
        extra = dict(image=[sources[k]], prior_token_image_ids=img_ids, source_image_grid_thw=grids)
    return pipe(
        r.prompt,
        prior_token_ids=r.prior_token_ids,
        guidance_scale=r.guidance_scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
        **extra,
    ).images


def test_source_codes_equal_diffusers(engine, priors, sources):
    """The engine's own tokenization of the source equals diffusers' (AR vision tokenizer)."""
    from vllm_omni_plugin.families.glm_image.processing import source_image_codes, upsample_codes

    processor, visual, vq = engine.adapter._vision_tokenizer()
    for (_, img_ids, grids), img in zip(priors, sources, strict=True):
        pix = processor.image_processor(images=[img], return_tensors="pt")
        grid = pix["image_grid_thw"]
        (codes,) = source_image_codes(visual, vq, pix["pixel_values"], grid)
        up = upsample_codes(codes, int(grid[0, 1]), int(grid[0, 2]))
        assert torch.equal(up[0], img_ids[0]), "source codes differ from diffusers'"
        assert tuple(grids[0][0].tolist()) == (1, 2 * int(grid[0, 1]), 2 * int(grid[0, 2]))


@pytest.mark.slow
def test_edit_alone_matches_diffusers(engine, pipe, priors, sources, pixel_diff):
    r = edit(priors, sources, "alone", 'a sign that says "hi"', 0, seed=3)
    (out,) = engine.generate([r])
    assert out.error is None, out.error
    want = reference(pipe, priors, sources, r, 0)[0]
    assert pixel_diff(out.images[0], want) <= TOLERANCE
    # The source image conditions the result: the same request on the other source differs.
    r2 = edit(priors, sources, "other", 'a sign that says "hi"', 1, seed=3)
    r2.prior_token_ids = r.prior_token_ids
    (out2,) = engine.generate([r2])
    assert pixel_diff(out.images[0], out2.images[0]) > 2 * TOLERANCE


@pytest.mark.slow
def test_edits_batched_with_text_to_image_match_diffusers(engine, pipe, priors, sources, staggered):
    """Two edits (other sources, other guidance, n=2) and a text-to-image request of the same
    size share engine steps, joining at different steps; each equals its own reference."""
    t2i = square_request(
        "t2i", "a red cube", SIZE, seed=5, steps=3, guidance_scale=1.5, prior_token_ids=priors[1][0]
    )
    first = [edit(priors, sources, "e0", "a red cube", 0, seed=0, steps=3), t2i]
    later = [edit(priors, sources, "e1", "a blue ball", 1, seed=1, steps=2, guidance=2.5, n=2)]
    results = staggered(engine, first, later, join_after_steps=1)
    assert max(o.metrics["max_batch"] for o in results.values()) >= 3
    source_of = {"e0": 0, "t2i": None, "e1": 1}  # request id -> index of its source image
    check_images(
        results,
        [first[0], t2i, later[0]],
        lambda r: reference(pipe, priors, sources, r, source_of[r.request_id]),
        TOLERANCE,
    )


def test_unusable_source_is_a_validation_error(engine, priors):
    bad = GenerationRequest(
        "x",
        "a cat",
        height=SIZE,
        width=SIZE,
        prior_token_ids=priors[0][0],
        input_images=[source_image(200, 40, 0)],  # aspect ratio 5: the processor refuses it
    )
    with pytest.raises(RequestValidationError) as e:
        engine.validate(bad)
    assert e.value.field == "image"
    two = GenerationRequest(
        "y",
        "a cat",
        height=SIZE,
        width=SIZE,
        prior_token_ids=priors[0][0],
        input_images=[source_image(64, 64, 0)] * 2,
    )
    with pytest.raises(RequestValidationError):
        engine.validate(two)
