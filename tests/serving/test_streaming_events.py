"""Streaming event shapes, read back by the openai package's own SSE decoder and event types.

Fast: no server, no model. The server tests (test_qwen_serve.py) drive the same events end to
end through the official client.
"""

from __future__ import annotations

import base64
import json

import pytest
from openai._streaming import SSEDecoder
from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent

from vllm_omni_plugin.common.limits import RequestLimits
from vllm_omni_plugin.common.messages import Progress
from vllm_omni_plugin.diffusion.request import preview_steps
from vllm_omni_plugin.serving.errors import APIError
from vllm_omni_plugin.serving.protocol import ImageLimits
from vllm_omni_plugin.serving.streaming import (
    completed_event,
    error_event,
    progress_events,
)
from vllm_omni_plugin.serving.validation import validate_request

LIMITS = ImageLimits.build(
    RequestLimits(
        granularity=16,
        min_height=16,
        min_width=16,
        max_height=1024,
        max_width=1024,
        max_steps=100,
        max_batch_size=4,
        default_height=64,
        default_width=64,
    ),
    None,
)


def events(text: str) -> list:
    decoder = SSEDecoder()
    out = []
    for line in text.splitlines():
        sse = decoder.decode(line)
        if sse is not None:
            out.append(sse)
    return out


def valid(**kw):
    return validate_request({"prompt": "a cat", "size": "64x32", "stream": True, **kw}, LIMITS)


def test_partial_and_completed_events_are_openai_types():
    req = valid(partial_images=2, quality="auto", background="opaque", output_format="webp")
    progress = Progress("r", 0, "diffusion", 3, 6, preview=[b"img0", b"img1"], preview_index=1)
    text = "".join(progress_events(req, progress))
    text += completed_event(req, b"final", {"stage_0": {"generated_tokens": 7}})
    got = events(text)
    # The progress comment is not an event for an SSE client: two previews, then the image.
    assert [e.event for e in got] == ["image_generation.partial_image"] * 2 + [
        "image_generation.completed"
    ]
    partials = [ImageGenPartialImageEvent.model_validate(e.json()) for e in got[:2]]
    assert [base64.b64decode(p.b64_json) for p in partials] == [b"img0", b"img1"]
    assert {p.partial_image_index for p in partials} == {1}
    p = partials[0]
    assert (p.type, p.size, p.quality, p.background, p.output_format) == (
        "image_generation.partial_image",
        "64x32",
        "auto",
        "opaque",
        "webp",
    )
    done = ImageGenCompletedEvent.model_validate(got[2].json())
    assert base64.b64decode(done.b64_json) == b"final"
    assert done.usage.output_tokens == 7 and done.usage.total_tokens == 7
    # Strict pydantic validation: every field the openai types require is there.
    assert set(got[2].json()) >= set(ImageGenCompletedEvent.model_fields) - {"safety_identifier"}


def test_progress_is_a_comment_unless_asked_as_events():
    progress = Progress("r", 1, "ar", 5, 10)
    plain = "".join(progress_events(valid(), progress))
    assert plain.startswith(": omni.progress ") and events(plain) == []
    data = json.loads(plain.split(" ", 2)[2])
    assert data == {
        "type": "omni.progress",
        "stage_id": 1,
        "stage": "ar",
        "step": 5,
        "total_steps": 10,
    }
    as_event = events("".join(progress_events(valid(progress_events=True), progress)))
    assert [e.event for e in as_event] == ["omni.progress"] and as_event[0].json() == data


def test_error_event_makes_the_openai_client_raise():
    body = APIError(504, "too slow", code="request_timeout", type="timeout_error").body()
    (sse,) = events(error_event(body))
    # openai's Stream raises APIError for any data object with an "error" mapping.
    assert sse.event == "error" and sse.json()["error"]["code"] == "request_timeout"


@pytest.mark.parametrize(
    "field",
    [
        {"partial_images": 4},
        {"partial_images": -1},
        {"partial_images": "2"},
        {"stream": "yes"},
        {"stream": 1},
    ],
)
def test_bad_stream_fields_are_400(field):
    with pytest.raises(APIError) as err:
        valid(**field)
    assert err.value.status == 400 and err.value.param == next(iter(field))


def test_stream_fields_default_off():
    req = validate_request({"prompt": "a"}, LIMITS)
    assert (req.stream, req.partial_images, req.progress_events) == (False, 0, False)


def test_preview_steps_are_evenly_spaced_and_never_the_last():
    assert preview_steps(10, 2) == (2, 5)
    assert preview_steps(12, 3) == (2, 5, 8)
    assert preview_steps(6, 1) == (2,)
    assert preview_steps(2, 3) == (0,)  # only one step before the last
    assert preview_steps(1, 3) == () and preview_steps(50, 0) == ()
    for total in range(1, 40):
        for n in range(4):
            got = preview_steps(total, n)
            assert list(got) == sorted(set(got)) and all(0 <= s < total - 1 for s in got)
            assert len(got) == min(n, total - 1)
