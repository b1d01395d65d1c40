"""Multi-rank DiT on CPU (gloo processes): cfg_parallel, ulysses_degree=2 and both composed
(4 ranks) give the images one process gives, for the tiny FLUX, Qwen-Image and GLM-Image DiTs,
with step-level batching on (requests join a running batch, CFG and non-CFG requests alternate).

Tolerance: every pixel of every image within 1 of 255 of the one-process image. Both runs are
fp32; the split changes only summation order (attention over a permuted key order, GEMMs over
fewer rows), ~1e-6 relative, which can flip a pixel's rounding and nothing more.

Follower processes are started once per world size and reused for every family and layout
(`build_engine(..., reuse=)`), which keeps the test at a few process starts.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.parallel import build_engine

pytestmark = pytest.mark.slow

SIZE = 64
FAMILIES = ("flux", "qwen-image", "glm-image")
# (cfg_parallel, ulysses_degree): world sizes 2, 2, 4.
LAYOUTS = ((True, 1), (False, 2), (True, 2))
# FLUX runs true CFG only with true_cfg_scale > 1 (and a negative prompt).
DEFAULTS = {"flux": {"true_cfg_scale": 4.0}}


def requests(family: str) -> tuple[list[GenerationRequest], list[GenerationRequest]]:
    """(first, later): `later` joins after one step. CFG rows of 1 and 2 images, a request
    without CFG (one row: every rank runs it), prompts of different lengths (uneven Ulysses
    text pieces; GLM-Image: different glyph lengths, so separate forwards)."""

    def r(rid, prompt, seed, steps, cfg, n=1):
        kw: dict = {}
        if family == "glm-image":
            gen = torch.Generator().manual_seed(seed)
            kw["prior_token_ids"] = torch.randint(0, 16, (1, 16), generator=gen)
            kw["guidance_scale"] = 1.5 if cfg else 1.0
        else:
            kw["negative_prompt"] = "blurry, low quality" if cfg else None
            if family == "flux":  # FLUX's embedded guidance; Qwen-Image would refuse it
                kw["guidance_scale"] = 3.5
        return GenerationRequest(
            rid, prompt, n=n, height=SIZE, width=SIZE, num_inference_steps=steps, seed=seed, **kw
        )

    first = [r("a", 'a sign saying "open late"', 1, 2, cfg=True)]
    later = [r("b", "a red cube", 2, 2, cfg=True, n=2), r("c", "a cat", 3, 2, cfg=False)]
    return first, later


def run(engine, family, staggered):
    first, later = requests(family)
    return staggered(engine, first, later, join_after_steps=1)


def config(tiny_models, family: str, **kw) -> DiffusionEngineConfig:
    return DiffusionEngineConfig(
        model=str(tiny_models(family)), max_batch_size=4, defaults=DEFAULTS.get(family), **kw
    )


@pytest.fixture(scope="module")
def references(tiny_models, staggered):
    return {f: run(DiffusionEngine(config(tiny_models, f)), f, staggered) for f in FAMILIES}


class RankPool:
    """The live rank-0 engine per world size; a new config takes over its followers."""

    def __init__(self) -> None:
        self.engines: dict[int, object] = {}
        self.deaths: list[tuple[int, int]] = []

    def engine(self, cfg: DiffusionEngineConfig):
        world = cfg.world_size
        for other in [w for w in self.engines if w != world]:
            self.engines.pop(other).ranks.close()  # one default process group per process
        old = self.engines.get(world)
        on_death = lambda rank, code: self.deaths.append((rank, code))  # noqa: E731
        self.engines[world] = build_engine(cfg, on_rank_death=on_death, reuse=old)
        return self.engines[world]

    def close(self) -> None:
        for e in self.engines.values():
            if getattr(e, "ranks", None) is not None:
                e.ranks.close()


@pytest.fixture(scope="module")
def pool():
    p = RankPool()
    try:
        yield p
    finally:
        p.close()


# World size 2 for every family first, then 4: one rank-0 process group at a time.
CASES = [(f, c, u) for c, u in LAYOUTS for f in FAMILIES]


@pytest.mark.parametrize(
    ("family", "cfg_parallel", "ulysses"),
    CASES,
    ids=[f"{f}-{'cfg+' if c else ''}u{u}" for f, c, u in CASES],
)
def test_parallel_images_equal_one_process(
    tiny_models, staggered, references, pool, family, cfg_parallel, ulysses
):
    cfg = config(tiny_models, family, cfg_parallel=cfg_parallel, ulysses_degree=ulysses)
    engine = pool.engine(cfg)
    got = run(engine, family, staggered)
    assert max(o.metrics["max_batch"] for o in got.values()) >= 3  # the join shared a step
    for rid, want in references[family].items():
        out = got[rid]
        assert out.error is None, out.error
        assert len(out.images) == len(want.images)
        for a, b in zip(out.images, want.images, strict=True):
            diff = np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16))
            assert diff.max() <= 1, (rid, int(diff.max()))
    # The work really was split: CFG rows over two ranks, attention over the Ulysses group.
    wrapper = engine.adapter.transformer
    if cfg_parallel:
        assert wrapper.splits + wrapper.spreads > 0
    if ulysses > 1:
        assert engine.adapter.ulysses.attention_calls > 0
    assert not pool.deaths


def test_a_dead_rank_is_reported(tiny_models, pool):
    # Runs last: it kills a follower of the 4-rank engine the tests above used. The stage's
    # handler (ranks._exit_stage) exits the stage process on this report (exit 71).
    engine = pool.engines[4]
    victim = engine.ranks.procs[1]  # rank 2
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not pool.deaths and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.deaths == [(2, -signal.SIGKILL)]


def test_ulysses_degree_must_divide_the_heads(tiny_models):
    from vllm_omni_plugin.diffusion.parallel.ulysses import enable_ulysses

    tr = DiffusionEngine(config(tiny_models, "flux")).adapter.pipe.transformer
    heads = int(tr.config.num_attention_heads)
    with pytest.raises(ValueError, match="does not divide"):
        enable_ulysses(tr, heads + 1, 0, None)
