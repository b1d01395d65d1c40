"""The `serving:` bounds on a chat request's image, audio and video parts (media_limits.py), on
real media made here: a PNG (PIL), a WAV (stdlib wave), an MP4 (PyAV). Every refusal is a 400
whose `param` is the part's path and whose message names the setting."""

from __future__ import annotations

import asyncio
import base64
import io
import wave

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from PIL import Image
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from vllm_omni_plugin.config.owners_common import ServingLimits
from vllm_omni_plugin.serving.chat_routes import CHAT_PATH, attach_chat_routes
from vllm_omni_plugin.serving.errors import APIError
from vllm_omni_plugin.serving.media_limits import MediaLimits, base64_decoded_size


def limits(**serving) -> MediaLimits:
    return MediaLimits.from_serving(ServingLimits(**serving))


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def wav(seconds: float, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(int(seconds * rate), np.int16).tobytes())
    return out.getvalue()


def mp4(frames: int) -> bytes:
    av = pytest.importorskip("av")
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            pixels = np.full((32, 32, 3), i * 10 % 256, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def data_url(raw: bytes, mime: str) -> str:
    return f"data:{mime};base64,{b64(raw)}"


def image_part(raw: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(raw, "image/png")}}


def audio_part(raw: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(raw), "format": "wav"}}


def video_part(raw: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(raw, "video/mp4")}}


def messages(*parts: dict) -> list[dict]:
    content = [{"type": "text", "text": "what is this?"}, *parts]
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]


def refusal(bounds: MediaLimits, msgs: list[dict]) -> APIError:
    with pytest.raises(APIError) as err:
        asyncio.run(bounds.check(msgs))
    assert err.value.status == 400 and err.value.body()["error"]["type"] == "invalid_request_error"
    return err.value


def test_media_within_the_bounds_pass():
    msgs = messages(image_part(png(64, 48)), audio_part(wav(1.0)), video_part(mp4(12)))
    bounds = limits(
        max_media_parts=3,
        max_input_image_pixels=64 * 48,
        max_input_audio_s=1.0,
        max_input_video_frames=12,
    )
    asyncio.run(bounds.check(msgs))
    asyncio.run(bounds.check([{"role": "user", "content": "text only"}]))


def test_too_many_parts_names_the_first_part_past_the_bound():
    msgs = messages(*[image_part(png(8, 8))] * 3)
    err = refusal(limits(max_media_parts=2), msgs)
    assert err.param == "messages[1].content[3]" and err.code == "too_many_media_parts"
    assert "serving.max_media_parts" in err.message and "3 image" in err.message
    # vLLM's shorthand (no `type`) and remote URLs count too.
    shorthand = [{"image_url": "https://example.com/a.png"}, {"video_url": {"url": "http://x/v"}}]
    err = refusal(limits(max_media_parts=1), messages(*shorthand))
    assert err.param == "messages[1].content[2]"


def test_a_part_larger_than_the_byte_bound_is_refused_before_decoding():
    raw = png(64, 64)
    err = refusal(limits(max_media_part_bytes=len(raw) - 1), messages(image_part(raw)))
    assert err.param == "messages[1].content[1]" and err.code == "media_part_too_large"
    assert "serving.max_media_part_bytes" in err.message and f"{len(raw)} bytes" in err.message
    # Sized from the length alone: text that is not even base64 is refused for its size first.
    junk = {"type": "input_audio", "input_audio": {"data": "!" * 400, "format": "wav"}}
    assert refusal(limits(max_media_part_bytes=100), messages(junk)).code == "media_part_too_large"
    for size in (0, 1, 2, 3, 100, 101, 102):
        assert base64_decoded_size(b64(bytes(size))) == size
        assert base64_decoded_size(data_url(bytes(size), "audio/wav")) == size


def test_an_image_with_more_pixels_than_the_bound_is_refused():
    err = refusal(limits(max_input_image_pixels=64 * 48 - 1), messages(image_part(png(64, 48))))
    assert err.param == "messages[1].content[1]" and err.code == "image_too_large"
    assert "64x48" in err.message and "serving.max_input_image_pixels" in err.message


def test_audio_longer_than_the_bound_is_refused():
    msgs = messages(image_part(png(8, 8)), audio_part(wav(2.0)))
    err = refusal(limits(max_input_audio_s=1.5), msgs)
    assert err.param == "messages[1].content[2]" and err.code == "audio_too_long"
    assert "2.0 s" in err.message and "serving.max_input_audio_s" in err.message
    url = {"type": "audio_url", "audio_url": {"url": data_url(wav(2.0), "audio/wav")}}
    assert refusal(limits(max_input_audio_s=1.5), messages(url)).code == "audio_too_long"


def test_a_video_with_more_frames_than_the_bound_is_refused():
    err = refusal(limits(max_input_video_frames=11), messages(video_part(mp4(12))))
    assert err.param == "messages[1].content[1]" and err.code == "video_too_long"
    assert "12 frames" in err.message and "serving.max_input_video_frames" in err.message


def test_a_video_whose_frames_have_more_pixels_than_the_bound_is_refused():
    """Each frame is held to the image bound (32 x 32 = 1024 pixels here)."""
    ok = limits(max_input_image_pixels=32 * 32)
    asyncio.run(ok.check(messages(video_part(mp4(3)))))
    err = refusal(limits(max_input_image_pixels=32 * 32 - 1), messages(video_part(mp4(3))))
    assert err.param == "messages[1].content[1]" and err.code == "video_too_large"
    assert "32x32" in err.message and "serving.max_input_image_pixels" in err.message


@pytest.mark.parametrize(
    "part, code",
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}, "image"),
        ({"type": "image_url", "image_url": {"url": data_url(wav(0.1), "image/png")}}, "image"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,%89PNG"}}, "image"),
        ({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}, "audio"),
        (
            {"type": "input_audio", "input_audio": {"data": b64(png(8, 8)), "format": "wav"}},
            "audio",
        ),
        ({"type": "video_url", "video_url": {"url": data_url(b"\0" * 64, "video/mp4")}}, "video"),
    ],
)
def test_an_undecodable_part_is_a_400_naming_it(part, code):
    err = refusal(limits(), messages(part))
    assert err.param == "messages[1].content[1]" and err.code == f"invalid_{code}"


def test_remote_urls_and_embeddings_are_left_to_vllm():
    parts = [
        {"type": "image_url", "image_url": {"url": "https://example.com/huge.png"}},
        {"type": "audio_url", "audio_url": {"url": "http://example.com/long.wav"}},
        {"type": "image_embeds", "image_embeds": "AAAA"},
    ]
    asyncio.run(limits(max_input_image_pixels=1, max_input_audio_s=0.01).check(messages(*parts)))


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_media_parts", -1),
        ("max_media_part_bytes", 0),
        ("max_input_video_frames", 0),
        ("max_input_image_pixels", 0),
    ],
)
def test_bounds_out_of_range_fail_at_load_naming_the_field(field, value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        ServingLimits(**{field: value})


async def _vllm_shaped_chat_endpoint(request: ChatCompletionRequest, raw_request: Request):
    """Stands where vLLM's own chat endpoint is: the same request class, the same signature."""
    raw_request.app.state.seen.append(len(request.messages))
    return {"messages": len(request.messages)}


def test_the_chat_route_reads_at_most_the_largest_legal_body():
    """The chat route (chat_routes.py) reads its body counted against
    `MediaLimits.max_body_bytes` before FastAPI parses it: past it a 413 in OpenAI's shape
    (declared length or chunked), and the handler is never called; within it, the request
    reaches the route's handler parsed as vLLM's ChatCompletionRequest."""
    app = FastAPI()
    seen: list[int] = []
    app.state.seen = seen
    app.post(CHAT_PATH)(_vllm_shaped_chat_endpoint)
    assert attach_chat_routes(app)
    app.state.omni_media_limits = limits(max_media_parts=2, max_media_part_bytes=3000)
    limit = app.state.omni_media_limits.max_body_bytes
    assert limit == 2 * 4000 + (1 << 20)

    async def post(content) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(
                CHAT_PATH, content=content, headers={"content-type": "application/json"}
            )

    small = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    ok = asyncio.run(post(small))
    assert ok.status_code == 200 and ok.json() == {"messages": 1}

    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * limit + b'"}]}'
    declared = asyncio.run(post(big))
    assert declared.status_code == 413, declared.text
    assert declared.json()["error"]["code"] == "body_too_large"

    async def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    streamed = asyncio.run(post(chunks()))
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "body_too_large"
    assert seen == [1]
