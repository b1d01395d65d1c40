"""Step caching with CUDA graphs, on a GPU (tiny FLUX, bf16): the engine keeps its graphs when a
stage enables step caching. Forwards without per-row paths through the blocks (uncached rows,
TaylorSeer's computed steps, also at the smaller batches its forecast rows leave) replay graphs of
the whole forward; forwards with first_block or teacache rows run uncaptured.

Tolerance 0 everywhere (pixel-exact on the 0-255 scale): a replay launches the very kernels of the
uncaptured call on the same shapes, so the graphed engine gives exactly the eager engine's
images, policy by policy, alone and batched. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.cuda_graphs import StepGraphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

SIZE = 64
ALL = {"policies": ["first_block", "teacache", "taylorseer"]}
POLICIES = [
    None,
    {"policy": "first_block", "threshold": 0.3},
    {"policy": "teacache", "threshold": 0.4},
    {"policy": "taylorseer", "interval": 3, "warmup": 2},
]


def engine(model_dir, graphs: bool) -> DiffusionEngine:
    cfg = DiffusionEngineConfig(
        model=str(model_dir),
        device="cuda",
        dtype="bfloat16",
        max_batch_size=4,
        step_cache=ALL,
        cuda_graphs=graphs,
        fuse_gelu=False,
    )
    return DiffusionEngine(cfg)


@pytest.fixture(scope="module")
def engines(tiny_models):
    folder = tiny_models("flux")
    return engine(folder, graphs=True), engine(folder, graphs=False)


def req(rid: str, seed: int, cache=None) -> GenerationRequest:
    return GenerationRequest(
        rid,
        "a photo of a cat",
        height=SIZE,
        width=SIZE,
        num_inference_steps=10,
        guidance_scale=3.5,
        seed=seed,
        cache=cache,
    )


def px(out) -> np.ndarray:
    return np.asarray(out.images[0], dtype=np.int16)


def test_graphs_stay_on_with_step_caching(engines):
    graphed, eager = engines
    assert isinstance(graphed.adapter.transformer, StepGraphs)
    assert graphed.step_cache is not None
    assert not isinstance(eager.adapter.transformer, StepGraphs)


@pytest.mark.parametrize("cache", POLICIES, ids=lambda c: "none" if c is None else c["policy"])
def test_each_policy_alone_equals_the_eager_engine(engines, cache):
    """Twice each (the second run replays what the first captured), against the eager engine."""
    graphed, eager = engines
    name = "none" if cache is None else cache["policy"]
    (ref,) = eager.generate([req(f"e-{name}", 3, cache)])
    stats = graphed.adapter.transformer.stats
    replays = stats["replays"]
    for attempt in range(2):
        (out,) = graphed.generate([req(f"g-{name}-{attempt}", 3, cache)])
        assert np.array_equal(px(out), px(ref)), (name, attempt)
    if name in ("none", "taylorseer"):  # computed steps replay the whole forward's graph
        assert stats["replays"] > replays


def test_a_mixed_batch_equals_the_eager_engine(engines):
    graphed, eager = engines
    for attempt in range(2):
        reqs = [req(f"m{i}-{attempt}", i, cache) for i, cache in enumerate(POLICIES)]
        got = {o.request_id: px(o) for o in graphed.generate(reqs)}
        ref = {o.request_id: px(o) for o in eager.generate(reqs)}
        assert got.keys() == ref.keys()
        for rid in got:
            assert np.array_equal(got[rid], ref[rid]), rid
