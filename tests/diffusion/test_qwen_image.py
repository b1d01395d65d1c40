"""Qwen-Image: engine images equal diffusers' QwenImagePipeline on the tiny checkpoint."""

from __future__ import annotations

import pytest
from family_helpers import check_images, reference_pipeline, seeded, square_request, tiny_engine

from vllm_omni_plugin.diffusion import GenerationRequest

SIZE = 64


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen-image")


@pytest.fixture(scope="module")
def engine(model_dir):
    return tiny_engine(model_dir, max_batch_size=8)


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import QwenImagePipeline

    return reference_pipeline(QwenImagePipeline, model_dir)


def reference(pipe, r: GenerationRequest):
    return pipe(
        r.prompt,
        negative_prompt=r.negative_prompt,
        true_cfg_scale=r.knobs.get("true_cfg_scale", 4.0),  # diffusers' default, and ours
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
    ).images


def req(rid, prompt, seed, steps=2, negative=None, cfg=None, n=1):
    """`cfg`: the request's true_cfg_scale (a guidance_scale is refused: this tiny model is not
    guidance-distilled, so diffusers would ignore it)."""
    return square_request(
        rid,
        prompt,
        SIZE,
        seed,
        steps,
        negative_prompt=negative,
        n=n,
        knobs={} if cfg is None else {"true_cfg_scale": cfg},
    )


def test_alone_matches_diffusers(engine, pipe, pixel_diff):
    r = req("alone", "a red cube", seed=7, negative="blurry")  # true CFG on
    (out,) = engine.generate([r])
    assert out.error is None
    assert out.images[0].size == (SIZE, SIZE)
    assert out.metrics["seed"] == 7
    assert pixel_diff(out.images[0], reference(pipe, r)[0]) <= 1.0


def test_batched_with_joins_matches_diffusers(engine, pipe, pixel_diff, staggered):
    first = [
        req("b0", "a red cube", seed=1, steps=3, negative="noise", cfg=2.5),
        req("b1", "a cat and the background of the text", seed=2, steps=2),
    ]
    later = [
        req("b2", "a cat", seed=3, steps=2, negative="ugly cat"),
        req("b3", "a red cube and a cat", seed=4, steps=4),
        req("b4", "cat", seed=5, steps=2, n=2),
    ]
    results = staggered(engine, first, later, join_after_steps=1)
    assert max(results[r.request_id].metrics["max_batch"] for r in first + later) >= 3
    check_images(results, first + later, lambda r: reference(pipe, r))
    # Different seeds/prompts give different pictures (the comparison is not vacuous).
    assert pixel_diff(results["b1"].images[0], results["b2"].images[0]) > 1.0


def test_progress_is_observable(engine):
    engine.add_request(req("p", "a cat", seed=0, steps=3))
    assert engine.progress("p") == (0, 3)
    seen = []
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.progress("p"))
    assert seen == [(1, 3), (2, 3), (3, 3)]
