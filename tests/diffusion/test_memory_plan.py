"""Memory planning counts what a request needs: its frames, its source images and the chosen
resolution. A request that cannot fit the stage's budget on its own is refused when it arrives
(CapacityError naming the field and the setting, before anything runs); requests that fit alone
share a forward only while their sum fits.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vllm_omni_plugin.common.memory import MemoryModel
from vllm_omni_plugin.diffusion import (
    CapacityError,
    DiffusionEngine,
    DiffusionEngineConfig,
    GenerationRequest,
)

GIB = 2**30


def image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))


def video(rid, size=32, frames=5, seed=0, steps=1, guidance=5.0):
    return GenerationRequest(
        rid,
        "a red cat",
        height=size,
        width=size,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        input_images=[image()],
    )


def test_the_estimate_grows_with_frames_resolution_and_source_images():
    m = MemoryModel(
        budget_bytes=GIB,
        limit="memory_budget_gb=1",
        element_bytes=2,
        hidden=64,
        heads=4,
        block=16,
        block_tokens=1,
        text_tokens=512,
        frame_step=4,
        source_video=True,
    )
    assert m.tokens(32, 32, frames=1) == 4 + 512
    assert m.tokens(32, 32, frames=9) == 3 * 4 + 512  # 1 + 2 latent frames
    assert m.request_bytes(32, 32, frames=9) > m.request_bytes(32, 32, frames=5)
    assert m.request_bytes(64, 64, frames=5) > m.request_bytes(32, 32, frames=5)
    with_image = m.request_bytes(32, 32, frames=5, sources=1)
    assert with_image > m.request_bytes(32, 32, frames=5)
    assert m.request_bytes(32, 32, frames=5, cfg=True) > m.request_bytes(32, 32, frames=5)
    edits = MemoryModel(GIB, "x", 2, 64, 4, 16, 1, 512, source_tokens=1000, source_pixels=4096)
    assert edits.tokens(32, 32, sources=2) == 4 + 512 + 2000  # source images' K/V in the sequence
    assert edits.request_bytes(32, 32, sources=2) > edits.request_bytes(32, 32, sources=1)
    assert MemoryModel.from_dict(m.to_dict()) == m


@pytest.fixture(scope="module")
def i2v(tiny_models):
    return str(tiny_models("wan-i2v"))


def test_a_video_that_cannot_fit_is_refused_at_admission(i2v):
    loose = DiffusionEngine(DiffusionEngineConfig(model=i2v, max_height=256, max_width=256))
    loose.validate(video("long", size=256, frames=65))  # no budget: no plan, accepted
    one = DiffusionEngine(
        DiffusionEngineConfig(model=i2v, max_height=256, max_width=256, memory_budget_gb=1.0),
        adapter=loose.adapter,
    )
    assert one.memory.budget_bytes == GIB - loose.adapter.weight_bytes()
    one.validate(video("fits"))
    with pytest.raises(CapacityError) as exc:
        one.add_request(video("long", size=256, frames=65))
    assert exc.value.field == "num_frames"
    assert "memory_budget_gb=1" in exc.value.message and "65 frames" in exc.value.message
    assert not one.has_unfinished()  # nothing was queued


def test_videos_that_fit_alone_but_not_together_take_turns(i2v):
    base = DiffusionEngine(DiffusionEngineConfig(model=i2v))
    weights = base.adapter.weight_bytes()
    engine = DiffusionEngine(
        DiffusionEngineConfig(model=i2v, max_batch_size=4, memory_budget_gb=1.0),
        adapter=base.adapter,
    )
    one = engine.memory.request_bytes(32, 32, frames=1, sources=1)
    budget_gb = (weights + 1.5 * one) / GIB  # room for one video's activations, not two
    engine = DiffusionEngine(
        DiffusionEngineConfig(model=i2v, max_batch_size=4, memory_budget_gb=budget_gb),
        adapter=base.adapter,
    )
    pair = [video(r, frames=1, seed=i, guidance=1.0) for i, r in enumerate("ab")]
    outs = engine.generate(pair)
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert [o.metrics["max_batch"] for o in outs] == [1, 1]
    roomy = DiffusionEngine(
        DiffusionEngineConfig(model=i2v, max_batch_size=4, memory_budget_gb=1.0),
        adapter=base.adapter,
    )
    outs = roomy.generate(pair)
    assert [o.metrics["max_batch"] for o in outs] == [2, 2]
