"""GLM-Image DiT stage: engine images equal diffusers' GlmImagePipeline given the same prior ids.

Prior token ids come from diffusers' own `generate_prior_tokens` on the tiny checkpoint (the AR
stage's job in production) and are passed to both diffusers and the engine.
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


def prior_ids(pipe, prompt: str, seed: int) -> torch.Tensor:
    ids, _, _ = pipe.generate_prior_tokens(
        prompt=prompt, height=SIZE, width=SIZE, generator=seeded(seed)
    )
    return ids


def reference(pipe, r: GenerationRequest):
    return pipe(
        r.prompt,
        prior_token_ids=r.prior_token_ids,
        guidance_scale=r.guidance_scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
    ).images


@pytest.fixture(scope="module")
def priors(pipe):
    # The AR pass is the slow part on CPU (~10 s each on the shared machine): make two and let
    # requests share them; the DiT does not care which prompt produced its prior ids.
    return [prior_ids(pipe, "a red cube", 0), prior_ids(pipe, 'a sign saying "hello"', 1)]


def req(priors, rid, prompt, seed, steps=2, guidance=1.5, n=1):
    return square_request(
        rid,
        prompt,
        SIZE,
        seed,
        steps,
        n=n,
        guidance_scale=guidance,
        prior_token_ids=priors[seed % 2],
    )


def test_engine_does_not_load_the_ar_model(engine):
    assert getattr(engine.adapter.pipe, "vision_language_encoder", None) is None


def test_alone_matches_diffusers(engine, pipe, priors, pixel_diff):
    r = req(priors, "alone", 'a sign that says "hi there"', seed=3)
    (out,) = engine.generate([r])
    assert out.error is None
    assert pixel_diff(out.images[0], reference(pipe, r)[0]) <= 1.0


def test_batched_with_joins_matches_diffusers(engine, pipe, priors, pixel_diff, staggered):
    # Mixed glyph lengths (none, one quote, two quotes), CFG on/off, steps 2-4, n=2.
    first = [
        req(priors, "g0", "a red cube", seed=0, steps=3),
        req(priors, "g1", 'a sign saying "hello"', seed=1, steps=2),
    ]
    later = [
        req(priors, "g2", "text 'ab' and 'cd'", seed=2, steps=4),
        req(priors, "g3", "a red cube", seed=9, steps=2, guidance=1.0),
        req(priors, "g4", "a blue ball", seed=4, steps=2, n=2),
    ]
    results = staggered(engine, first, later, join_after_steps=1)
    assert max(o.metrics["max_batch"] for o in results.values()) >= 3
    check_images(results, first + later, lambda r: reference(pipe, r))
    assert pixel_diff(results["g0"].images[0], results["g3"].images[0]) > 1.0


def test_prior_token_ids_are_validated(engine, priors):
    good = priors[0]
    with pytest.raises(RequestValidationError) as e:
        engine.validate(GenerationRequest("x", "a cat", height=SIZE, width=SIZE))
    assert e.value.field == "prior_token_ids"
    with pytest.raises(RequestValidationError) as e:  # grid of another size
        engine.validate(
            GenerationRequest("x", "a cat", height=SIZE * 2, width=SIZE, prior_token_ids=good)
        )
    assert e.value.field == "prior_token_ids"
    bad = good.clone()
    bad[0, 0] = 10**6
    with pytest.raises(RequestValidationError) as e:
        engine.validate(
            GenerationRequest("x", "a cat", height=SIZE, width=SIZE, prior_token_ids=bad)
        )
    assert e.value.field == "prior_token_ids"
