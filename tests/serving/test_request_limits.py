"""Request limits have one owner: the final stage's RequestLimits (computed by its engine) plus
`serving:`; serving only compares against them. No server needed."""

from __future__ import annotations

import pytest

from vllm_omni_plugin.common.limits import MAX_SEED, RequestLimits, size_granularity
from vllm_omni_plugin.config.owners_common import ServingLimits
from vllm_omni_plugin.serving.errors import APIError
from vllm_omni_plugin.serving.protocol import ImageLimits
from vllm_omni_plugin.serving.validation import validate_request

STAGE = RequestLimits(
    granularity=16,
    min_height=32,
    min_width=64,
    max_height=256,
    max_width=512,
    max_steps=50,
    max_batch_size=3,
    default_height=64,
    default_width=64,
)


def limits(**serving) -> ImageLimits:
    return ImageLimits.build(STAGE, ServingLimits(**serving))


def refused(lim: ImageLimits, body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        validate_request(body, lim)
    return info.value


def test_negative_prompt_has_its_own_limit():
    lim = limits(max_prompt_chars=100, max_negative_prompt_chars=10)
    validate_request({"prompt": "p" * 100, "negative_prompt": "n" * 10}, lim)
    err = refused(lim, {"prompt": "p", "negative_prompt": "n" * 11})
    assert err.param == "negative_prompt" and "the limit is 10" in err.message
    # A negative prompt may be longer than the prompt limit when configured so.
    wide = limits(max_prompt_chars=5, max_negative_prompt_chars=50)
    validate_request({"prompt": "p", "negative_prompt": "n" * 50}, wide)
    assert refused(wide, {"prompt": "p" * 6}).param == "prompt"


def test_stage_limits_are_what_serving_checks():
    lim = limits(max_n=8)
    assert lim.max_n == 3  # capped by the stage's batch size
    validate_request({"prompt": "a", "size": "64x32"}, lim)  # per-dimension minimums
    assert refused(lim, {"prompt": "a", "size": "32x32"}).param == "size"  # width < 64
    assert refused(lim, {"prompt": "a", "size": "72x64"}).param == "size"  # not a multiple of 16
    assert refused(lim, {"prompt": "a", "num_inference_steps": 51}).param == "num_inference_steps"
    validate_request({"prompt": "a", "seed": MAX_SEED}, lim)
    assert refused(lim, {"prompt": "a", "seed": MAX_SEED + 1}).param == "seed"


def test_limits_round_trip_and_granularity_rule():
    assert RequestLimits.from_dict(STAGE.to_dict()) == STAGE
    with pytest.raises(ValueError, match="unknown"):
        RequestLimits.from_dict({**STAGE.to_dict(), "max_pixels": 1})
    with pytest.raises(TypeError):
        RequestLimits.from_dict({"granularity": 16})
    # Both the family's and the configured granularity must divide the size.
    assert size_granularity(16, 24) == 48 and size_granularity(16, None) == 16
