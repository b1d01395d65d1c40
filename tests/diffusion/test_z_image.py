"""Z-Image-Turbo: engine images equal diffusers' ZImagePipeline (guidance_scale=0, Turbo's
setting) on the tiny checkpoint, alone and batched with joins; tolerance: mean absolute pixel
difference <= 1.0 on the 0-255 scale (same seed, same weights, 32x32)."""

from __future__ import annotations

import pytest
from family_helpers import check_images, reference_pipeline, seeded, square_request, tiny_engine

from vllm_omni_plugin.diffusion import GenerationRequest
from vllm_omni_plugin.diffusion.errors import RequestValidationError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

SIZE = 32


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("z-image")


@pytest.fixture(scope="module")
def engine(model_dir):
    return tiny_engine(model_dir, min_size=SIZE)


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import ZImagePipeline

    return reference_pipeline(ZImagePipeline, model_dir)


def reference(pipe, r: GenerationRequest):
    return pipe(
        r.prompt,
        guidance_scale=0.0,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
    ).images


def req(rid, prompt, seed, steps=2, n=1):
    return square_request(rid, prompt, SIZE, seed, steps, n=n)


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
    check_images(results, first + later, lambda r: reference(pipe, r))
    assert pixel_diff(results["z0"].images[0], results["z2"].images[0]) > 1.0  # not vacuous


@pytest.mark.parametrize("field", ["guidance_scale", "negative_prompt"])
def test_cfg_fields_are_refused_not_ignored(engine, field):
    r = req("cfg", "a cat", seed=0)
    setattr(r, field, 4.0 if field == "guidance_scale" else "blurry")
    with pytest.raises(RequestValidationError) as info:
        engine.validate(r)
    assert info.value.field == field
