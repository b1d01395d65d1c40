"""The x-omni-stage-timings header's AR figures: TokenClock's rule (time to first token from the
request's entry into the engine; per output token over the tokens after the first output) and
their place in the header (parts of their stage's time, not added to the stages' sum)."""

from __future__ import annotations

import json
import time

import pytest

from vllm_omni_plugin.serving.handlers import stage_timings
from vllm_omni_plugin.stages.token_clock import TokenClock


def test_token_clock_counts_tokens_after_the_first_output():
    clock = TokenClock()
    assert clock.metrics() == {}  # no token yet: no figure
    time.sleep(0.02)
    clock.saw(2)  # the first output already holds 2 tokens (the loop fell behind)
    clock.saw(2)  # no new token: not a new arrival
    time.sleep(0.03)
    clock.saw(5)
    m = clock.metrics()
    assert m["ttft_s"] >= 0.02
    # 3 tokens came after the first output, over >= 30 ms
    assert m["tpot_s"] == pytest.approx((clock.last_at - clock.first_at) / 3)
    assert m["tpot_s"] >= 0.01
    one = TokenClock()
    one.saw(1)
    assert set(one.metrics()) == {"ttft_s"}  # one token: no time per token


def test_header_carries_ttft_and_tpot_without_counting_them_twice():
    metrics = {
        "stage_0": {"generated_tokens": 261, "stage_s": 1.5, "ttft_s": 0.02, "tpot_s": 0.0055},
        "stage_1": {"stage_s": 0.5, "decode_s": 0.1},
    }
    out = json.loads(stage_timings(metrics, server_ms=2100.0))
    assert out == {
        "stage_0": 1500.0,
        "stage_0_ttft": 20.0,
        "stage_0_tpot": 5.5,
        "stage_1": 500.0,
        "decode": 100.0,
        "other": 100.0,
    }
