"""The served AR comparison (benchmarks/bench_ar_served.py) on the tiny GLM-Image, both sides for
real: ours is conftest's shared GLM-Image server (its AR stage greedy), stock is `vllm serve` of
the same AR checkpoint with the settings the bench derives from the same stage config. Both get
the same requests at concurrency 1 and 2; every record's time to first token and per output
token is positive (ours from the x-omni-stage-timings header, stock from streamed chunks).

Tokens equal: the stock server's greedy tokens for request 0, through diffusers' GLM-Image DiT
(same prompt, seed and steps), give ours' served image within 1.0 of 255 mean absolute pixel
difference (fp32 on both sides); the same tokens with one grid code changed do not (a control:
the image depends on the tokens)."""

from __future__ import annotations

import asyncio
import base64
import io
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import GREEDY_GLM_OVERRIDES
from omni_server import API_KEY, REPO
from PIL import Image

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_ar_served as bench  # noqa: E402

from vllm_omni_plugin.families.glm_image.processing import (  # noqa: E402
    num_image_tokens,
    tokens_to_prior_token_ids,
)

pytestmark = pytest.mark.slow
SIZE, STEPS = 64, 2
TOLERANCE = 1.0  # mean absolute pixel difference, 0-255


def diffusers_image(pipe, prompt: str, tokens: list[int], seed: int) -> np.ndarray:
    image = pipe(
        prompt,
        prior_token_ids=tokens_to_prior_token_ids(tokens, SIZE, SIZE),
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=1.5,  # glm_image_tiny.yaml's default
        generator=torch.Generator("cpu").manual_seed(seed),
    ).images[0]
    return np.asarray(image, dtype=np.float32)


def test_ours_and_stock_serve_the_same_tokens_and_report_per_token_times(
    shared_glm_server, tmp_path
):
    """Over 60 s on 2 cores: a stock `vllm serve` starts here (the comparison needs it), and
    as the session's first user of the shared GLM-Image server this test also waits for that
    server's start-up (an AR stage with its vLLM engine, and a DiT stage)."""
    model = shared_glm_server.model
    config = str(REPO / "stage_configs" / "glm_image_tiny.yaml")
    stage = bench.ar_stage(config, GREEDY_GLM_OVERRIDES, model)
    args = SimpleNamespace(model=model, size=SIZE, steps=STEPS, requests=2, concurrency=2)
    stock = bench.Server(
        bench.stock_argv(stage, model), tmp_path / "stock.log", bench.stock_env(stage)
    )
    try:
        # Ours while the stock server starts (the shared server is up already).
        ours = asyncio.run(bench.measure("ours", shared_glm_server.url, args, stage, API_KEY))
        stock.wait_ready(300)
        theirs = asyncio.run(bench.measure("stock", stock.url, args, stage))
    finally:
        stock.stop()
    budget = num_image_tokens(SIZE, SIZE) + 1
    for level in ours + theirs:
        assert level["requests"] == 2 and level["concurrency"] in (1, 2)
        assert all(v > 0 for v in level["tpot_ms"] + level["ttft_ms"]), level
    assert [lv["concurrency"] for lv in ours] == [lv["concurrency"] for lv in theirs] == [1, 2]
    for level in theirs:
        assert level["tokens"] == [budget, budget]
    # Greedy: the stock tokens of request 0 are the same at both concurrencies ...
    first = [lv["_results"][0]["tokens"] for lv in theirs]
    assert first[0] == first[1]
    # ... and they are the tokens ours' AR stage wrote: its image is the DiT's for them.
    served = np.asarray(
        Image.open(io.BytesIO(base64.b64decode(ours[0]["_results"][0]["b64"]))).convert("RGB"),
        dtype=np.float32,
    )
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(str(model))
    pipe.set_progress_bar_config(disable=True)
    prompt = bench.PROMPTS[0]
    same = diffusers_image(pipe, prompt, first[0], seed=1000)
    assert np.abs(served - same).mean() < TOLERANCE
    changed = list(first[0])
    changed[-2] = (changed[-2] + 1) % stage_codes(stage)  # one code of the large grid
    other = diffusers_image(pipe, prompt, changed, seed=1000)
    assert np.abs(served - other).mean() > TOLERANCE

    rows = [{**lv, "device": "cpu", "size": SIZE, "steps": STEPS} for lv in ours + theirs]
    table = bench.report(rows)
    assert "#### cpu, 64x64" in table and "#### NVIDIA H200, 1024x1024" in table
    assert table.count("not measured") == 4  # the H200's rows, both systems, c1 and c8
    assert "| 2 | " in table and "(n=1)" in table


def stage_codes(stage) -> int:
    """Image codes are the ids below the image-start token (the grid spec's num_codes)."""
    body = bench.completion_body(stage, "m", "x", SIZE, 0)
    return body["vllm_xargs"]["omni_image_grid"][1]
