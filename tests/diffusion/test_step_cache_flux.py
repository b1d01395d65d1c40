"""Step caching on tiny FLUX: off is bit-identical to no step cache; first_block and taylorseer
alone give diffusers' own hooks' image (same pipeline and seed, pixel-exact: tolerance 0 on the
0-255 scale); a mixed batch (policies, thresholds, steps, n differ per row) gives each request
what it gives alone (tolerance: mean abs pixel difference <= 1.0, the engine's batching
tolerance), with skips counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.errors import RequestValidationError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

SIZE = 64
ALL = {"policies": ["first_block", "teacache", "taylorseer"]}


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("flux")


@pytest.fixture(scope="module")
def plain(model_dir):
    return DiffusionEngine(DiffusionEngineConfig(model=str(model_dir), max_batch_size=6))


@pytest.fixture(scope="module")
def cached(model_dir):
    cfg = DiffusionEngineConfig(model=str(model_dir), max_batch_size=7, step_cache=ALL)
    return DiffusionEngine(cfg)


def req(rid, seed, steps=8, cache=None, n=1, prompt="a photo of a cat"):
    return GenerationRequest(
        rid,
        prompt,
        n=n,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=3.5,
        seed=seed,
        cache=cache,
    )


def px(img) -> np.ndarray:
    return np.asarray(img, dtype=np.int16)


def diffusers_image(model_dir, r: GenerationRequest, hook) -> np.ndarray:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(hook)
    image = pipe(
        r.prompt,
        guidance_scale=r.guidance_scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(r.seed),
    ).images[0]
    return px(image)


def test_off_is_bit_identical_to_no_step_cache(plain, cached):
    (a,) = plain.generate([req("a", 3)])
    for cache in (None, {"policy": "none"}, {"policy": "first_block", "threshold": 0}):
        (b,) = cached.generate([req("b", 3, cache=cache)])
        assert np.array_equal(px(a.images[0]), px(b.images[0])), cache


@pytest.mark.parametrize("threshold", [0.25, 0.45])
def test_first_block_alone_equals_diffusers_hook(cached, model_dir, threshold):
    from diffusers import FirstBlockCacheConfig

    before = cached.cache_skipped().get("first_block", 0)
    r = req(f"fb{threshold}", 5, cache={"policy": "first_block", "threshold": threshold})
    (out,) = cached.generate([r])
    skipped = cached.cache_skipped().get("first_block", 0) - before
    assert 0 < skipped < r.num_inference_steps
    ref = diffusers_image(model_dir, r, FirstBlockCacheConfig(threshold=threshold))
    assert np.array_equal(px(out.images[0]), ref)


def test_taylorseer_alone_equals_diffusers_lite_hook(cached, model_dir):
    from diffusers import TaylorSeerCacheConfig

    policy = {"policy": "taylorseer", "interval": 3, "warmup": 2, "order": 1}
    before = cached.cache_skipped().get("taylorseer", 0)
    r = req("ts", 6, steps=10, cache=policy)
    (out,) = cached.generate([r])
    assert cached.cache_skipped().get("taylorseer", 0) - before > 0
    hook = TaylorSeerCacheConfig(
        cache_interval=3,
        disable_cache_before_step=2,
        max_order=1,
        taylor_factors_dtype=torch.float32,
        use_lite_mode=True,
    )
    ref = diffusers_image(model_dir, r, hook)
    assert np.abs(px(out.images[0]) - ref).max() <= 1


def test_mixed_batch_equals_alone(cached, staggered, pixel_diff):
    reqs = [
        req("m0", 0, steps=8, cache={"policy": "first_block", "threshold": 0.3}),
        req("m1", 1, steps=6, cache={"policy": "teacache", "threshold": 0.4}),
        req("m2", 2, steps=9, cache={"policy": "taylorseer", "interval": 2, "warmup": 1}),
        req("m3", 3, steps=7),
        req("m4", 4, steps=8, cache={"policy": "first_block", "threshold": 0.05}, n=2),
        req("m5", 5, steps=6, cache={"policy": "teacache", "threshold": 0.6}),
    ]
    alone = {r.request_id: cached.generate([r])[0] for r in reqs}
    results = staggered(cached, reqs[:2], reqs[2:], join_after_steps=2)
    assert max(o.metrics["max_batch"] for o in results.values()) >= 4
    for r in reqs:
        for a, b in zip(alone[r.request_id].images, results[r.request_id].images, strict=True):
            assert pixel_diff(a, b) <= 1.0, r.request_id


@pytest.mark.parametrize(
    "cache, field",
    [
        ({"policy": "magic"}, "cache.policy"),
        ({"policy": "first_block", "threshold": -0.1}, "cache.threshold"),
        ({"policy": "first_block", "threshold": 99}, "cache.threshold"),
        ({"policy": "first_block", "interval": 2}, "cache.interval"),
        ({"policy": "taylorseer", "interval": 0}, "cache.interval"),
        ("first_block", "cache"),
    ],
)
def test_bad_cache_refused_naming_the_field(cached, cache, field):
    with pytest.raises(RequestValidationError) as exc:
        cached.validate(req("bad", 0, cache=cache))
    assert exc.value.field == field


def test_policy_refused_where_the_stage_has_no_step_cache(plain):
    with pytest.raises(RequestValidationError) as exc:
        plain.validate(req("x", 0, cache={"policy": "teacache", "threshold": 0.2}))
    assert exc.value.field == "cache.policy"


def test_previews_and_progress_count_cached_steps(cached):
    r = req("pv", 7, steps=8, cache={"policy": "first_block", "threshold": 0.45})
    r.partial_images = 2
    before = cached.cache_skipped().get("first_block", 0)
    cached.add_request(r)
    previews, progress, outs = [], [], []
    while cached.has_unfinished():
        outs += cached.step()
        previews += [i for i, _ in cached.take_previews().values()]
        if not outs:
            progress.append(cached.progress("pv")[0])
    assert cached.cache_skipped().get("first_block", 0) - before > 0
    assert previews == [0, 1]
    assert progress == list(range(1, 8))  # every step counted, cached or not
    assert outs[0].metrics["steps"] == 8 and outs[0].metrics["cache_skipped"] > 0
