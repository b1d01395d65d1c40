"""Z-Image-Turbo: engine images equal diffusers' ZImagePipeline (guidance_scale=0, Turbo's
setting) on the tiny checkpoint, alone and batched with joins; tolerance: mean absolute pixel
difference <= 1.0 on the 0-255 scale (same seed, same weights, 32x32)."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.errors import RequestValidationError

SIZE = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("z-image")


@pytest.fixture(scope="module")
def engine(model_dir):
    return DiffusionEngine(
        DiffusionEngineConfig(
            model=str(model_dir), max_batch_size=4, min_height=SIZE, min_width=SIZE
        )
    )


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import ZImagePipeline

    p = ZImagePipeline.from_pretrained(str(model_dir))
    p.set_progress_bar_config(disable=True)
    return p


def reference(pipe, r: GenerationRequest):
    return pipe(
        r.prompt,
        guidance_scale=0.0,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=torch.Generator("cpu").manual_seed(r.seed),
    ).images


def req(rid, prompt, seed, steps=2, n=1):
    return GenerationRequest(
        rid, prompt, n=n, height=SIZE, width=SIZE, num_inference_steps=steps, seed=seed
    )


def test_alone_matches_diffusers(engine, pipe, pixel_diff):
    r = req("alone", "a photo of a cat", seed=11)
    (out,) = engine.generate([r])
    assert out.error is None
    assert out.images[0].size == (SIZE, SIZE)
    assert pixel_diff(out.images[0], reference(pipe, r)[0]) <= 1.0


def test_batched_with_joins_matches_diffusers(engine, pipe, pixel_diff, staggered):
    """Prompts of different lengths and step counts share forwards; requests join mid-run."""
    first = [req("z0", "a red cube", seed=0, steps=3), req("z1", "a cat with the cube", seed=1)]
    later = [req("z2", "cat", seed=2, steps=3), req("z3", "a red photo of the cat", seed=3, n=2)]
    results = staggered(engine, first, later, join_after_steps=1)
    assert max(o.metrics["max_batch"] for o in results.values()) >= 3
    for r in first + later:
        out = results[r.request_id]
        assert out.error is None, out.error
        for got, want in zip(out.images, reference(pipe, r), strict=True):
            assert pixel_diff(got, want) <= 1.0, r.request_id
    assert pixel_diff(results["z0"].images[0], results["z2"].images[0]) > 1.0  # not vacuous


@pytest.mark.parametrize("field", ["guidance_scale", "negative_prompt"])
def test_cfg_fields_are_refused_not_ignored(engine, field):
    r = req("cfg", "a cat", seed=0)
    setattr(r, field, 4.0 if field == "guidance_scale" else "blurry")
    with pytest.raises(RequestValidationError) as info:
        engine.validate(r)
    assert info.value.field == field
