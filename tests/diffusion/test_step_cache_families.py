"""Step caching on every family's tiny checkpoint (Qwen-Image, Qwen-Image-Edit, GLM-Image text to
image and edits, Wan2.2 with its two experts): off is bit-identical to an engine without a step
cache; a mixed batch (first_block / teacache / taylorseer / none, different thresholds and step
counts, CFG rows) gives each request what it gives alone (mean abs pixel difference <= 1.0 on the
0-255 scale, the engine's batching tolerance) and really skips.

For CPU time Qwen-Image-Edit conditions on a 64x64-pixel area (the adapter's `condition_pixels`,
as in test_qwen_image_edit.py) instead of diffusers' 1 MP: the source image's tokens still join
every row of the transformer and the text encoder; at 1 MP they were 4096 per row and the
module took 44 s of its 50 alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.adapters.loader import load_pipeline, torch_dtype
from vllm_omni_plugin.diffusion.adapters.qwen_image_edit import QwenImageEditAdapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

ALL = {"policies": ["first_block", "teacache", "taylorseer"]}
FB = {"policy": "first_block", "threshold": 0.3}
TEA = {"policy": "teacache", "threshold": 0.5}
TAY = {"policy": "taylorseer", "interval": 2, "warmup": 1}


class SmallConditionAdapter(QwenImageEditAdapter):
    condition_pixels = 64 * 64


def image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def family_request(kind: str, engine: DiffusionEngine):
    size = 32 if kind == "wan" else 64

    def make(rid, seed, steps, cache=None, negative=None):
        extra = {}
        if kind.startswith("glm"):
            adapter = engine.adapter
            grid = adapter.vae_scale_factor * adapter.patch
            vocab = int(adapter.pipe.transformer.config.prior_vq_quantizer_codebook_size)
            g = torch.Generator().manual_seed(seed)
            extra["prior_token_ids"] = torch.randint(
                0, vocab, (1, (size // grid) ** 2), generator=g
            )
        if kind in ("glm-image-edit", "qwen-image-edit"):
            extra["input_images"] = [image(64, 96, seed % 2)]
        if kind == "wan":
            extra["num_frames"] = 5
        return GenerationRequest(
            rid,
            f"prompt {seed}",
            # GLM-Image takes no negative prompt (its uncond pass reads an empty one; a
            # negative prompt is refused), yet runs CFG: its CFG rows still decide together.
            negative_prompt=None if kind.startswith("glm") else negative,
            height=size,
            width=size,
            num_inference_steps=steps,
            seed=seed,
            cache=cache,
            **extra,
        )

    return make


KINDS = {
    "qwen-image": "qwen-image",
    "qwen-image-edit": "qwen-image-edit",
    "glm-image": "glm-image",
    "glm-image-edit": "glm-image",
    "wan": "wan",
}


def family_engine(kind: str, folder: str, **config) -> DiffusionEngine:
    cfg = DiffusionEngineConfig(model=folder, max_batch_size=6, **config)
    if kind != "qwen-image-edit":
        return DiffusionEngine(cfg)
    device, dtype = torch.device(cfg.device), torch_dtype(cfg.dtype)
    pipe = load_pipeline(folder, dtype, device, skip=SmallConditionAdapter.skip_components)
    return DiffusionEngine(cfg, SmallConditionAdapter(pipe, device, dtype, {}))


@pytest.fixture(scope="module", params=list(KINDS))
def family(request, tiny_models):
    kind = request.param
    folder = str(tiny_models(KINDS[kind]))
    plain = family_engine(kind, folder)
    cached = family_engine(kind, folder, step_cache=ALL)
    return kind, plain, cached


def frames(out) -> np.ndarray:
    return np.stack([np.asarray(i.convert("RGB"), dtype=np.float64) for i in out.images])


def test_off_is_bit_identical(family):
    kind, plain, cached = family
    make = family_request(kind, plain)
    (a,) = plain.generate([make("a", 1, 4, negative="blurry")])
    (b,) = cached.generate([make("b", 1, 4, negative="blurry")])
    assert np.array_equal(frames(a), frames(b))


def test_mixed_batch_equals_alone_and_skips(family, staggered):
    kind, _, cached = family
    make = family_request(kind, cached)
    reqs = [
        make("m0", 0, 8, FB, negative="blurry"),
        make("m1", 1, 6, TEA, negative="dark"),
        make("m2", 2, 7, TAY, negative="ugly"),
        make("m3", 3, 5, negative="noisy"),
    ]
    before = cached.cache_skipped()
    alone = {r.request_id: frames(cached.generate([r])[0]) for r in reqs}
    skipped = cached.cache_skipped()
    for policy in ("first_block", "teacache", "taylorseer"):
        assert skipped.get(policy, 0) > before.get(policy, 0), (kind, policy, skipped)
    results = staggered(cached, reqs[:2], reqs[2:], join_after_steps=2)
    assert max(o.metrics["max_batch"] for o in results.values()) >= 3
    for r in reqs:
        got = frames(results[r.request_id])
        assert np.abs(got - alone[r.request_id]).mean() <= 1.0, (kind, r.request_id)


def test_wan_expert_switch_resets_the_cache(tiny_models):
    folder = str(tiny_models("wan"))
    engine = DiffusionEngine(DiffusionEngineConfig(model=folder, step_cache=ALL))
    make = family_request("wan", engine)
    engine.add_request(make("w", 0, 8, {"policy": "first_block", "threshold": 5.0}))
    seen = []  # (expert, computed?) per step
    while engine.has_unfinished():
        state = engine.scheduler.find("w")
        engine.step()
        if state is not None and state.step_cache is not None:
            seen.append((state.step_cache.expert, state.step_cache.compute))
    experts = [e for e, _ in seen]
    switch = experts.index(1)  # Wan2.2's low-noise expert takes over here
    assert 0 < switch < len(seen) - 1
    # Each expert's first step computes (its cache starts empty); with this threshold every
    # other step reuses the cache of its own expert.
    assert [c for _, c in seen] == [i in (0, switch) for i in range(len(seen))]
