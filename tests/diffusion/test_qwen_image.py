"""Qwen-Image: engine images equal diffusers' QwenImagePipeline on the tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest

SIZE = 64


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen-image")


@pytest.fixture(scope="module")
def engine(model_dir):
    return DiffusionEngine(DiffusionEngineConfig(model=str(model_dir), max_batch_size=8))


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import QwenImagePipeline

    p = QwenImagePipeline.from_pretrained(str(model_dir))
    p.set_progress_bar_config(disable=True)
    return p


def reference(pipe, r: GenerationRequest):
    out = pipe(
        r.prompt,
        negative_prompt=r.negative_prompt,
        true_cfg_scale=r.knobs.get("true_cfg_scale", 4.0),  # diffusers' default, and ours
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=torch.Generator("cpu").manual_seed(r.seed),
    )
    return out.images


def req(rid, prompt, seed, steps=2, negative=None, cfg=None, n=1):
    """`cfg`: the request's true_cfg_scale (a guidance_scale is refused: this tiny model is not
    guidance-distilled, so diffusers would ignore it)."""
    return GenerationRequest(
        rid,
        prompt,
        negative_prompt=negative,
        n=n,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        seed=seed,
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
    for r in first + later:
        out = results[r.request_id]
        assert out.error is None, out.error
        ref = reference(pipe, r)
        assert len(out.images) == r.n
        for got, want in zip(out.images, ref, strict=True):
            assert pixel_diff(got, want) <= 1.0, r.request_id
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
