"""FLUX.1: engine images equal diffusers' FluxPipeline on the tiny checkpoint (guidance-embedded,
as FLUX.1-dev), alone, batched with joins, and with true CFG from the stage defaults."""

from __future__ import annotations

import pytest
from family_helpers import check_images, reference_pipeline, seeded, square_request, tiny_engine

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest

SIZE = 64


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("flux")


@pytest.fixture(scope="module")
def engine(model_dir):
    return tiny_engine(model_dir)


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import FluxPipeline

    return reference_pipeline(FluxPipeline, model_dir)


def reference(pipe, r: GenerationRequest, true_cfg_scale: float = 1.0):
    return pipe(
        r.prompt,
        negative_prompt=r.negative_prompt,
        true_cfg_scale=true_cfg_scale,
        guidance_scale=r.guidance_scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=seeded(r.seed),
    ).images


def req(rid, prompt, seed, steps=2, guidance=3.5, n=1, negative=None):
    return square_request(
        rid, prompt, SIZE, seed, steps, negative_prompt=negative, n=n, guidance_scale=guidance
    )


def test_alone_matches_diffusers(engine, pipe, pixel_diff):
    r = req("alone", "a photo of a cat", seed=11)
    (out,) = engine.generate([r])
    assert out.error is None
    assert pixel_diff(out.images[0], reference(pipe, r)[0]) <= 1.0


def test_batched_with_joins_and_batch_limit(engine, pipe, staggered):
    first = [req("f0", "a red cube", seed=0, steps=3), req("f1", "a cat", seed=1, guidance=5.0)]
    later = [
        req("f2", "the cat with a cube", seed=2, steps=4),
        req("f3", "red", seed=3, n=2),
        req("f4", "a photo", seed=4, steps=2),
    ]
    results = staggered(engine, first, later, join_after_steps=2)
    sizes = [o.metrics["max_batch"] for o in results.values()]
    assert max(sizes) <= 4  # max_batch_size honoured
    assert max(sizes) >= 3
    check_images(results, first + later, lambda r: reference(pipe, r))


def test_true_cfg_from_stage_defaults(model_dir, pipe, pixel_diff):
    engine = DiffusionEngine(
        DiffusionEngineConfig(
            model=str(model_dir),
            defaults={
                "true_cfg_scale": 3.0,
                "num_inference_steps": 2,
                "height": SIZE,
                "width": SIZE,
            },
        )
    )
    rs = [
        GenerationRequest("c0", "a red cube", negative_prompt="a cat", seed=5),
        GenerationRequest("c1", "a cat", negative_prompt="blur", seed=6),
    ]
    outs = engine.generate(rs)
    for r, out in zip(rs, outs, strict=True):
        assert out.error is None
        r = engine.validate(r)
        assert pixel_diff(out.images[0], reference(pipe, r, true_cfg_scale=3.0)[0]) <= 1.0


def test_fuse_gelu_knob_reaches_the_transformer_and_keeps_the_image(model_dir, pipe, pixel_diff):
    """`fuse_gelu` from the stage config: on CPU off unless asked (None), on when asked, and the
    fused engine's image is still diffusers' (the CPU fused modules compute the same ops)."""
    from vllm_omni_plugin.config.owners_diffusion import DiffusionOwner
    from vllm_omni_plugin.diffusion.gelu_epilogue import LinearGeluTanh

    def fused_modules(engine):
        return sum(isinstance(m, LinearGeluTanh) for m in engine.adapter.pipe.transformer.modules())

    default = DiffusionEngineConfig.from_owner(DiffusionOwner(device="cpu"), model=str(model_dir))
    assert default.fuse_gelu is None
    assert fused_modules(DiffusionEngine(default)) == 0  # None: CUDA only

    asked = DiffusionOwner(device="cpu", fuse_gelu=True, min_height=SIZE, min_width=SIZE)
    engine = DiffusionEngine(DiffusionEngineConfig.from_owner(asked, model=str(model_dir)))
    assert fused_modules(engine) > 0
    r = req("fused", "a photo of a cat", seed=11)
    (out,) = engine.generate([r])
    assert out.error is None
    assert pixel_diff(out.images[0], reference(pipe, r)[0]) <= 1.0
