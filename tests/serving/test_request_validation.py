"""Request validation and response plumbing, without a server: every bad request becomes an
OpenAI-shaped 4xx before anything could reach a stage."""

from __future__ import annotations

import json
import time

import pytest

from vllm_omni_plugin.common.limits import RequestLimits
from vllm_omni_plugin.serving.errors import APIError
from vllm_omni_plugin.serving.protocol import ImageLimits
from vllm_omni_plugin.serving.url_store import UrlStore
from vllm_omni_plugin.serving.validation import MAX_BODY_BYTES, parse_body, validate_request

LIMITS = ImageLimits(
    stage=RequestLimits(
        granularity=16,
        min_height=64,
        min_width=64,
        max_height=256,
        max_width=512,
        max_steps=200,
        max_batch_size=8,
        default_height=64,
        default_width=64,
    ),
    max_n=4,
    max_prompt_chars=100,
    max_negative_prompt_chars=100,
)


def check(body: bytes | dict) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        validate_request(parse_body(raw), LIMITS)
    err = info.value
    shape = err.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert 400 <= err.status < 500 and shape["message"]
    return err


def test_valid_request_fills_defaults():
    req = validate_request({"prompt": "a cat"}, LIMITS)
    assert (req.width, req.height, req.n, req.response_format, req.output_format) == (
        64,
        64,
        1,
        "b64_json",
        "png",
    )
    req = validate_request(
        {
            "prompt": "a",
            "size": "512x256",
            "n": 4,
            "seed": 7,
            "num_inference_steps": 200,
            "guidance_scale": 0,
            "response_format": "url",
            "output_format": "webp",
            "quality": "auto",
            "background": "opaque",
        },  # OpenAI's fields, in the values that describe what we do
        LIMITS,
    )
    assert (req.width, req.height, req.n, req.seed, req.num_inference_steps) == (
        512,
        256,
        4,
        7,
        200,
    )


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({}, "prompt", "missing_required_parameter"),
        ({"prompt": 5}, "prompt", "invalid_type"),
        ({"prompt": ["a"]}, "prompt", "invalid_type"),
        ({"prompt": "   "}, "prompt", "invalid_value"),
        ({"prompt": "x" * 101}, "prompt", "string_above_max_length"),
        (
            {"prompt": "a", "negative_prompt": "x" * 101},
            "negative_prompt",
            "string_above_max_length",
        ),
        ({"prompt": "a", "size": "64"}, "size", "invalid_value"),
        ({"prompt": "a", "size": "64x"}, "size", "invalid_value"),
        ({"prompt": "a", "size": "-64x64"}, "size", "invalid_value"),
        ({"prompt": "a", "size": "65x64"}, "size", "invalid_value"),
        ({"prompt": "a", "size": "64x4096"}, "size", "invalid_value"),
        ({"prompt": "a", "size": "48x64"}, "size", "invalid_value"),
        ({"prompt": "a", "size": "99999999x64"}, "size", "invalid_value"),
        ({"prompt": "a", "size": 64}, "size", "invalid_type"),
        ({"prompt": "a", "n": 0}, "n", "invalid_value"),
        ({"prompt": "a", "n": 5}, "n", "invalid_value"),
        ({"prompt": "a", "n": "2"}, "n", "invalid_type"),
        ({"prompt": "a", "n": 1.5}, "n", "invalid_type"),
        ({"prompt": "a", "n": True}, "n", "invalid_type"),
        ({"prompt": "a", "num_inference_steps": 0}, "num_inference_steps", "invalid_value"),
        ({"prompt": "a", "num_inference_steps": 201}, "num_inference_steps", "invalid_value"),
        ({"prompt": "a", "response_format": "png"}, "response_format", "invalid_value"),
        ({"prompt": "a", "output_format": "gif"}, "output_format", "invalid_value"),
        ({"prompt": "a", "seed": "1"}, "seed", "invalid_type"),
        ({"prompt": "a", "seed": 1.5}, "seed", "invalid_type"),
        ({"prompt": "a", "seed": -1}, "seed", "invalid_value"),
        ({"prompt": "a", "seed": 2**64}, "seed", "invalid_value"),
        ({"prompt": "a", "guidance_scale": -1}, "guidance_scale", "invalid_value"),
        ({"prompt": "a", "guidance_scale": "high"}, "guidance_scale", "invalid_type"),
        ({"prompt": "a", "cache": "fast"}, "cache", "invalid_type"),
        ({"prompt": "a", "cache": {"policy": "magic"}}, "cache.policy", "invalid_value"),
        ({"prompt": "a", "cache": {"threshold": 0.1}}, "cache.policy", "invalid_value"),
        (
            {"prompt": "a", "cache": {"policy": "first_block", "threshold": -1}},
            "cache.threshold",
            "invalid_value",
        ),
        (
            {"prompt": "a", "cache": {"policy": "teacache", "interval": 2}},
            "cache.interval",
            "invalid_value",
        ),
    ],
)
def test_bad_fields(body, param, code):
    err = check(body)
    assert err.status == 400
    assert (err.param, err.code) == (param, code), err.message


def test_a_well_formed_size_out_of_range_is_told_its_range():
    """However many digits it has, a WIDTHxHEIGHT size is read and told the range it missed."""
    for size, axis in (("99999999x64", "width 99999999"), ("64x100000", "height 100000")):
        assert f"{axis} is outside [64, " in check({"prompt": "a", "size": size}).message
    assert "must look like" in check({"prompt": "a", "size": "9999999999x64"}).message


@pytest.mark.parametrize("raw", [b"{bad", b"", b"[1, 2]", b'"prompt"', b"\xff\xfe"])
def test_malformed_json(raw):
    err = check(raw)
    assert (err.status, err.code) == (400, "invalid_json")


def test_nan_guidance_and_oversized_body():
    assert check(b'{"prompt": "a", "guidance_scale": NaN}').param == "guidance_scale"
    err = check(b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}')
    assert err.status == 413


def test_url_store_bounds_and_expiry():
    store = UrlStore(max_items=2, max_bytes=10, ttl_s=0.2)
    a = store.put(b"aaaa", "image/png")
    b = store.put(b"bbbb", "image/png")
    c = store.put(b"cccc", "image/png")  # evicts a (count bound)
    assert store.get(a) is None and store.get(b) == (b"bbbb", "image/png") and store.get(c)
    d = store.put(b"dddddddd", "image/png")  # 12 bytes > 10: evicts b and c
    assert store.get(b) is None and store.get(c) is None and store.get(d)
    assert store.get("not-a-token") is None
    time.sleep(0.25)
    assert store.get(d) is None and len(store) == 0


def test_cache_field_from_forms_and_json():
    from vllm_omni_plugin.serving import cache_field

    form = {"prompt": "p", "cache[policy]": "taylorseer", "cache[interval]": "3"}
    folded = cache_field.fold_form(form)
    assert folded == {"prompt": "p", "cache": {"policy": "taylorseer", "interval": 3}}
    assert cache_field.checked(folded["cache"]) == {
        "policy": "taylorseer",
        "interval": 3,
        "warmup": 3,
        "order": 1,
    }
    assert cache_field.fold_form({"cache": '{"policy": "none"}'}) == {"cache": {"policy": "none"}}
    assert cache_field.checked(None) is None
    for bad, param in (
        ({"cache": "fast"}, "cache"),
        ({"cache[policy]": "teacache", "cache[threshold]": "low"}, "cache.threshold"),
    ):
        with pytest.raises(APIError) as info:
            cache_field.fold_form(bad)
        assert (info.value.status, info.value.param) == (400, param)
    with pytest.raises(APIError) as info:
        cache_field.checked({"policy": "taylorseer", "threshold": 0.1})
    assert (info.value.status, info.value.param) == (400, "cache.threshold")
