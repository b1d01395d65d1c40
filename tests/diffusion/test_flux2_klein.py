"""FLUX.2 klein: engine images equal diffusers' Flux2KleinPipeline on the tiny checkpoint
(not step-distilled, so CFG with the empty prompt runs when guidance_scale > 1): text to image
alone and batched with joins, and edits with one and two reference images batched. Tolerance:
mean absolute pixel difference <= 1.0 on the 0-255 scale (same seed, same weights, 32x32); for
edits <= 0.02 (measured: 0.0003), because the tiny random transformer barely listens to its
reference tokens (a reference moves the image by ~0.1-0.4), so 1.0 could not tell a dropped
reference from a used one."""

from __future__ import annotations

import pytest
from family_helpers import (
    check_images,
    noise_picture,
    reference_pipeline,
    seeded,
    square_request,
    tiny_engine,
)

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.errors import RequestValidationError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

SIZE = 32
EDIT_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("flux2-klein")


@pytest.fixture(scope="module")
def engine(model_dir):
    return tiny_engine(model_dir, min_size=SIZE)


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import Flux2KleinPipeline

    return reference_pipeline(Flux2KleinPipeline, model_dir)


def reference(pipe, r: GenerationRequest):
    return pipe(
        image=list(r.input_images) or None,
        prompt=r.prompt,
        guidance_scale=r.guidance_scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
    ).images


def req(rid, prompt, seed, steps=2, guidance=4.0, n=1, images=()):
    return square_request(
        rid, prompt, SIZE, seed, steps, n=n, guidance_scale=guidance, input_images=list(images)
    )


def test_text_to_image_batched_with_joins_and_cfg(engine, pipe, pixel_diff, staggered):
    """CFG (guidance 4) and no-CFG (guidance 1) requests, joining at different steps."""
    first = [req("k0", "a red cube", seed=0, steps=3), req("k1", "a cat", seed=1, guidance=1.0)]
    later = [req("k2", "a photo of the cat", seed=2, guidance=1.0, n=2)]
    results = staggered(engine, first, later, join_after_steps=1)
    assert max(o.metrics["max_batch"] for o in results.values()) >= 2
    check_images(results, first + later, lambda r: reference(pipe, r))
    assert pixel_diff(results["k1"].images[0], results["k2"].images[0]) > 1.0  # not vacuous


def test_edits_with_reference_images_batched(engine, pipe, pixel_diff, staggered):
    """Two edits with CFG whose references crop to the same 64x64 share forwards (their
    empty-prompt rows carry the references too); a 2-image edit without CFG runs beside."""
    first = [
        req("e0", "a red cube", seed=3, images=[noise_picture(1, 64, 72)]),
        req("e1", "a cat", seed=4, images=[noise_picture(2, 72, 64)]),
    ]
    later = [req("e2", "make it red", seed=5, guidance=1.0, images=[noise_picture(3, 64, 64)] * 2)]
    results = staggered(engine, first, later, join_after_steps=1)
    assert results["e0"].metrics["max_batch"] == 2  # e0 and e1: same reference size 64x64
    check_images(results, first + later, lambda r: reference(pipe, r), EDIT_TOLERANCE)
    # Not vacuous: without its references the same request gives a farther image.
    for r in (first[0], later[0]):
        plain = reference(pipe, req("plain", r.prompt, seed=r.seed, guidance=r.guidance_scale))[0]
        assert pixel_diff(results[r.request_id].images[0], plain) > 2 * EDIT_TOLERANCE


def test_refused_fields(engine):
    with pytest.raises(RequestValidationError) as info:
        engine.validate(GenerationRequest("neg", "a cat", negative_prompt="blur"))
    assert info.value.field == "negative_prompt"
    with pytest.raises(RequestValidationError) as info:  # diffusers' own check: >= 64 px
        engine.validate(req("small", "a cat", seed=0, images=[noise_picture(0, 32, 64)]))
    assert info.value.field == "image"
    with pytest.raises(RequestValidationError) as info:
        engine.validate(req("many", "a cat", seed=0, images=[noise_picture(0, 64, 64)] * 5))
    assert info.value.field == "image"


def test_step_distilled_checkpoint_runs_without_cfg(model_dir, tmp_path, pixel_diff):
    """`is_distilled: true` (klein 4B/9B): no CFG rows, guidance_scale refused; the image is
    diffusers' (which ignores its guidance_scale there)."""
    import json

    from diffusers import Flux2KleinPipeline

    distilled = tmp_path / "klein-distilled"
    distilled.mkdir()
    for part in model_dir.iterdir():
        if part.is_dir():
            (distilled / part.name).symlink_to(part)
    index = json.loads((model_dir / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    engine = DiffusionEngine(
        DiffusionEngineConfig(model=str(distilled), min_height=SIZE, min_width=SIZE)
    )
    r = square_request("d", "a red cube", SIZE, seed=9, steps=2)
    assert not engine.adapter.uses_cfg(engine.validate(r))
    with pytest.raises(RequestValidationError) as info:
        engine.validate(req("g", "a cat", seed=0, guidance=4.0))
    assert info.value.field == "guidance_scale"
    (out,) = engine.generate([r])
    pipe = reference_pipeline(Flux2KleinPipeline, distilled)
    want = pipe(
        prompt=r.prompt, height=SIZE, width=SIZE, num_inference_steps=2, generator=seeded(9)
    ).images[0]
    assert pixel_diff(out.images[0], want) <= 1.0
