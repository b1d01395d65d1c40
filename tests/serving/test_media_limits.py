"""The `serving:` bounds on a chat request's image, audio and video parts (media_limits.py), on
real media made here: a PNG (PIL), a WAV (stdlib wave), an MP4 (PyAV). Every refusal is a 400
whose `param` is the part's path and whose message names the setting."""

from __future__ import annotations

import asyncio
import base64
import io
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from free_ports import free_port
from media_host import MediaHost
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


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": ""}},
        {"type": "image_url", "image_url": {}},
        {"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}},
        {"image_url": "a.png"},
        {"type": "audio_url", "audio_url": {"url": None}},
        {"type": "video_url", "video_url": {"url": "gopher://example.com/v.mp4"}},
    ],
)
def test_a_url_part_without_a_url_anything_reads_is_a_400_naming_it(part):
    """Before this check such parts reached vLLM's renderer, whose 400 named no part (for an
    empty URL: "multi_modal_data['image'][0] is empty but multi_modal_uuids ... is missing")."""
    err = refusal(limits(), messages(part))
    kind = next(k for k in ("image", "audio", "video") if k in str(part))
    assert err.param == "messages[1].content[1]" and err.code == f"invalid_{kind}"
    assert "data: URL, an http(s) URL or a file: URL" in err.message


def test_a_part_named_by_its_uuid_alone_is_left_to_vllm():
    """vLLM takes an item that carries a `uuid` and no URL from its cache of processed media."""
    part = {"type": "image_url", "image_url": None, "uuid": "a-cached-image"}
    asyncio.run(limits().check(messages(part)))


def test_embeddings_are_sized_not_decoded():
    asyncio.run(limits(max_input_image_pixels=1).check(messages({"image_embeds": "AAAA"})))


def test_a_file_url_is_read_from_the_allowed_folder_only(tmp_path):
    """`file:` URLs: a 400 unless the chat stage names a folder (vLLM's
    allowed_local_media_path); within it the file is read here and held to the bounds like an
    inline part; outside it, missing, or too large: a 400 naming the part."""
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "a.png").write_bytes(png(64, 48))
    (tmp_path / "outside.png").write_bytes(png(8, 8))

    def part(path) -> dict:
        return {"type": "image_url", "image_url": {"url": Path(path).as_uri()}}

    err = refusal(limits(), messages(part(folder / "a.png")))
    assert (err.param, err.code) == ("messages[1].content[1]", "url_not_allowed")
    assert "allowed_local_media_path" in err.message
    local = MediaLimits.from_serving(ServingLimits(), str(folder))
    inside = part(folder / "a.png")
    asyncio.run(local.check(messages(inside)))
    prefix = "data:application/octet-stream;base64,"
    assert base64.b64decode(inside["image_url"]["url"][len(prefix) :]) == png(64, 48)
    for path, code in (
        (tmp_path / "outside.png", "url_not_allowed"),
        (folder / ".." / "outside.png", "url_not_allowed"),
        (folder / "missing.png", "url_fetch_failed"),
    ):
        assert refusal(local, messages(part(path))).code == code, path
    small = MediaLimits.from_serving(ServingLimits(max_input_image_pixels=100), str(folder))
    assert refusal(small, messages(part(folder / "a.png"))).code == "image_too_large"
    tiny = MediaLimits.from_serving(ServingLimits(max_media_part_bytes=100), str(folder))
    assert refusal(tiny, messages(part(folder / "a.png"))).code == "media_part_too_large"


def remote(part_type: str, url: str) -> dict:
    return {"type": part_type, part_type: {"url": url}}


def test_a_remote_url_off_the_listed_hosts_is_refused_without_a_fetch():
    """As for edits (serving.edit_url_hosts, none by default): a 400 naming the part and the
    setting, and the server behind the URL is never asked."""
    with MediaHost({"/a.png": png(8, 8)}) as host:
        for hosts, url in (
            ((), host.url),
            (("127.0.0.1",), host.url.replace("127.0.0.1", "localhost")),
        ):
            msgs = messages(image_part(png(8, 8)), remote("image_url", f"{url}/a.png"))
            err = refusal(limits(edit_url_hosts=list(hosts)), msgs)
            assert (err.param, err.code) == ("messages[1].content[2]", "url_not_allowed")
            assert "serving.edit_url_hosts" in err.message
        assert host.requests == []


def test_a_remote_part_on_a_listed_host_is_fetched_once_and_held_to_the_bounds():
    """Each http(s) part is fetched (no redirect followed) and stands in the request as the
    data: URL of exactly the bytes that arrived, so vLLM fetches nothing; those bytes meet the
    bounds a part sent inline meets."""
    files = {"/a.png": png(64, 48), "/a.wav": wav(2.0), "/a.mp4": mp4(12)}
    with MediaHost(files) as host:
        parts = [
            remote("image_url", f"{host.url}/a.png"),
            remote("audio_url", f"{host.url}/a.wav"),
            remote("video_url", f"{host.url}/a.mp4"),
            {"image_url": f"{host.url}/a.png"},  # vLLM's shorthand
        ]
        msgs = messages(*parts)
        bounds = dict(edit_url_hosts=["127.0.0.1"], max_input_audio_s=2.0)
        asyncio.run(limits(**bounds, max_input_video_frames=12).check(msgs))
        assert sorted(host.requests) == sorted(["/a.png", "/a.wav", "/a.mp4", "/a.png"])
        urls = [parts[0]["image_url"]["url"], parts[1]["audio_url"]["url"]]
        urls += [parts[2]["video_url"]["url"], parts[3]["image_url"]]
        prefix = "data:application/octet-stream;base64,"
        assert all(u.startswith(prefix) for u in urls)
        sent = [base64.b64decode(u[len(prefix) :]) for u in urls]
        assert sent == [files["/a.png"], files["/a.wav"], files["/a.mp4"], files["/a.png"]]

        def refused(part: dict, **more) -> APIError:
            return refusal(limits(**{**bounds, **more}), messages(part))

        err = refused(remote("image_url", f"{host.url}/a.png"), max_input_image_pixels=100)
        assert (err.param, err.code) == ("messages[1].content[1]", "image_too_large")
        assert refused(remote("audio_url", f"{host.url}/a.wav"), max_input_audio_s=1.0).code == (
            "audio_too_long"
        )
        err = refused(remote("video_url", f"{host.url}/a.mp4"), max_input_video_frames=11)
        assert err.code == "video_too_long"


def test_a_fetch_that_fails_is_a_400_naming_the_part(monkeypatch):
    """Not found, a redirect, a refused connection, more bytes than
    serving.max_media_part_bytes, and a server that has not answered by the deadline (it is
    held until the test ends): each a 400 naming the part, never a 500."""
    from vllm_omni_plugin.serving import edit_urls

    monkeypatch.setattr(edit_urls, "FETCH_TIMEOUT_S", 0.5)
    with MediaHost({"/a.png": png(64, 64), "/hold": png(8, 8)}, {"/moved": "/a.png"}) as host:
        bounds = limits(edit_url_hosts=["127.0.0.1"])
        for path, code in (("/gone.png", "url_fetch_failed"), ("/moved", "url_fetch_failed")):
            err = refusal(bounds, messages(remote("image_url", f"{host.url}{path}")))
            assert (err.param, err.code) == ("messages[1].content[1]", code), err.message
        size = len(png(64, 64))
        small = limits(edit_url_hosts=["127.0.0.1"], max_media_part_bytes=size - 1)
        err = refusal(small, messages(remote("image_url", f"{host.url}/a.png")))
        assert err.code == "media_part_too_large" and "serving.max_media_part_bytes" in err.message
        err = refusal(bounds, messages(remote("video_url", f"{host.url}/hold")))
        assert err.code == "url_fetch_failed" and "0.5 s" in err.message
    closed = f"http://127.0.0.1:{free_port()}/a.png"
    assert refusal(bounds, messages(remote("image_url", closed))).code == "url_fetch_failed"


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
