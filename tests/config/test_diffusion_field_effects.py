"""Diffusion-stage fields that used to be accepted and ignored now change what the engine does:
gpu_memory_utilization, max_batch_tokens, request_batch_max_wait_ms, vae_use_slicing /
vae_use_tiling (real tiny Qwen-Image engine, CPU)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from vllm_omni_plugin.common.memory import row_tokens
from vllm_omni_plugin.config.owners_diffusion import DiffusionOwner
from vllm_omni_plugin.diffusion import (
    CapacityError,
    DiffusionEngine,
    DiffusionEngineConfig,
    DiffusionEngineError,
    GenerationRequest,
)

HOST_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
DEFAULTS = {"num_inference_steps": 2, "height": 64, "width": 64, "guidance_scale": 1.0}


@pytest.fixture(scope="module")
def model(tiny_models):
    return str(tiny_models("qwen-image"))


@pytest.fixture(scope="module")
def adapter(model):
    """One loaded model shared by the engines below (each engine applies its own config)."""
    return DiffusionEngine(DiffusionEngineConfig(model=model, defaults=DEFAULTS)).adapter


def engine_for(model, adapter, **owner_fields) -> DiffusionEngine:
    owner = DiffusionOwner(
        device="cpu", dtype="float32", min_height=64, min_width=64, **owner_fields
    )
    cfg = DiffusionEngineConfig.from_owner(owner, model=model, defaults=DEFAULTS)
    return DiffusionEngine(cfg, adapter=adapter)


def test_gpu_memory_utilization_sets_the_memory_budget(model, adapter):
    weights = adapter.weight_bytes()
    small = adapter.row_bytes(64, 64)
    # Room for the weights and one 64x64 image, not for a 512x512 one.
    frac = (weights + 2 * small) / HOST_BYTES
    engine = engine_for(model, adapter, gpu_memory_utilization=frac, max_height=512, max_width=512)
    assert engine._budget_bytes == int(frac * HOST_BYTES)
    engine.validate(GenerationRequest("ok", "a cat", height=64, width=64))
    with pytest.raises(CapacityError):
        engine.validate(GenerationRequest("big", "a cat", height=512, width=512))
    # Without it the same request is accepted: the value is what changed the behaviour.
    free = engine_for(model, adapter, max_height=512, max_width=512)
    free.validate(GenerationRequest("big", "a cat", height=512, width=512))
    # A fraction too small for the weights refuses to start, naming the field.
    with pytest.raises(DiffusionEngineError, match="gpu_memory_utilization"):
        engine_for(model, adapter, gpu_memory_utilization=weights / 2 / HOST_BYTES)


def test_request_batch_max_wait_ms_holds_an_idle_engine_for_a_batch(model, adapter):
    held = engine_for(model, adapter, max_batch_size=2, request_batch_max_wait_ms=5000)
    held.add_request(GenerationRequest("a", "a cat", seed=1))
    assert held.step() == [] and held.progress("a") == (0, 2)  # held, not started
    assert held.hold_s() > 4
    held.add_request(GenerationRequest("b", "a dog", seed=2))  # the batch is full: go
    assert held.hold_s() == 0
    outs = []
    while held.has_unfinished():
        outs += held.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert all(o.metrics["mean_batch"] == 2 for o in outs)  # every step shared

    eager = engine_for(model, adapter, max_batch_size=2)
    eager.add_request(GenerationRequest("a", "a cat", seed=1))
    eager.step()
    assert eager.progress("a") == (1, 2)  # started alone at once

    # A lone request waits out the hold, then runs.
    short = engine_for(model, adapter, max_batch_size=2, request_batch_max_wait_ms=300)
    t0 = time.perf_counter()
    (out,) = short.generate([GenerationRequest("c", "a cat", seed=3)])
    assert out.error is None and out.metrics["queue_s"] >= 0.29
    assert time.perf_counter() - t0 >= 0.29


def test_vae_slicing_and_tiling_reach_the_vae(model, adapter):
    vae = adapter.pipe.vae
    engine = engine_for(model, adapter, vae_use_slicing=True, vae_use_tiling=True)
    assert (vae.use_slicing, vae.use_tiling) == (True, True)
    (out,) = engine.generate([GenerationRequest("t", "a cat", n=2, seed=4)])
    assert out.error is None and len(out.images) == 2
    engine_for(model, adapter, vae_use_slicing=False, vae_use_tiling=False)
    assert (vae.use_slicing, vae.use_tiling) == (False, False)


def test_max_batch_tokens_keeps_requests_above_it_apart(model, adapter):
    """Two 64x64 requests (no CFG: one row each) share every step without the bound, and with
    room for exactly one row they run one after the other; one request alone above the bound
    still runs (alone)."""
    row = adapter.memory_facts()
    one = row_tokens(row, 64, 64)
    outs = {}
    for bound in (None, one, one - 1):
        engine = engine_for(model, adapter, max_batch_size=2, max_batch_tokens=bound)
        outs[bound] = engine.generate(
            [GenerationRequest("a", "a cat", seed=1), GenerationRequest("b", "a dog", seed=2)]
        )
    assert all(o.error is None for o in outs[None]) and all(
        o.metrics["max_batch"] == 2 for o in outs[None]
    )
    for bound in (one, one - 1):
        assert all(o.error is None and o.metrics["max_batch"] == 1 for o in outs[bound])
    # Apart or together, the same image within 1/255 per pixel (the two prompts' lengths
    # differ, so together their text is padded and masked).
    for apart, together in zip(outs[one], outs[None], strict=True):
        diff = np.abs(np.asarray(apart.images[0], float) - np.asarray(together.images[0], float))
        assert diff.max() <= 1.0
    # An idle engine holding requests for a batch stops holding once they fill the bound.
    held = engine_for(
        model, adapter, max_batch_size=2, max_batch_tokens=one, request_batch_max_wait_ms=5000
    )
    held.add_request(GenerationRequest("c", "a cat", seed=3))
    assert held.hold_s() == 0
    with pytest.raises(ValueError, match="max_batch_tokens"):
        engine_for(model, adapter, max_batch_tokens=0)
