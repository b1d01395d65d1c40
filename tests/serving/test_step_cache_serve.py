"""Step caching served (the session's small Qwen-Image server, step_cache enabled with
max_threshold 6): a request's `cache` through the official openai client (extra_body) skips steps
and the skips show on /metrics as omni_cache_skipped_total; `cache: none` gives exactly the
image of a request without `cache` (pixel-exact); a bad policy is a 400 from the API server, a
threshold over the stage's max_threshold a 400 from the stage, both naming the field."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from omni_server import API_KEY
from openai import OpenAI
from PIL import Image


@pytest.fixture(scope="module")
def client(small_qwen_server) -> OpenAI:
    return OpenAI(
        base_url=f"{small_qwen_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


def skipped(server, policy: str) -> float:
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("omni_cache_skipped_total{") and f'policy="{policy}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def image(client, **extra) -> np.ndarray:
    out = client.images.generate(
        prompt="a red cube",
        size="64x64",
        extra_body={"seed": 5, "num_inference_steps": 4, **extra},
    )
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))))


def test_cache_skips_steps_and_counts_them(small_qwen_server, client):
    before = skipped(small_qwen_server, "teacache")
    image(client, cache={"policy": "teacache", "threshold": 5.0})
    # teacache computes the first and last steps; with this threshold it skips the two between.
    assert skipped(small_qwen_server, "teacache") - before == 2


def test_cache_none_is_the_uncached_image(client):
    assert np.array_equal(image(client), image(client, cache={"policy": "none"}))


@pytest.mark.parametrize(
    "cache, param",
    [
        ({"policy": "magic"}, "cache.policy"),
        ({"policy": "first_block", "threshold": 8.0}, "cache.threshold"),  # > max_threshold 6
    ],
)
def test_bad_cache_is_a_400_naming_the_field(client, cache, param):
    with pytest.raises(openai.BadRequestError) as info:
        image(client, cache=cache)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param
