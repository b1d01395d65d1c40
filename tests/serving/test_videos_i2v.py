"""Wan2.2 image-to-video on /v1/videos through the official openai client: `vllm serve` of the
tiny I2V-A14B and TI2V-5B checkpoints with their bundled CPU files (session servers shared with
other tests of the route), `input_reference` uploaded as the client sends it (multipart) or as
a data: URL in JSON, checked like the edits route's uploads before any job exists.

Frame tolerance against diffusers (WanImageToVideoPipeline on the same folder, weights, seed and
source image; prompt embeddings from WanPipeline's encoder, see tests/diffusion/test_wan_i2v.py):
the served MP4's frames equal diffusers' frames put through the same H.264 encoder within a mean
absolute difference of MAX_ROUNDTRIP_DIFF (below).
"""

from __future__ import annotations

import base64
import functools
import io
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import av
import httpx
import numpy as np
import pytest
import torch
from omni_server import API_KEY
from openai import APIStatusError, BadRequestError, OpenAI
from PIL import Image

from vllm_omni_plugin.stages.videos_encode import encode_mp4

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
PROMPT = "a red cat"
FRAMES, STEPS = 5, 3
# Served frames against diffusers' frames of the same request through the same MP4 encoder (uint8
# RGB, mean absolute difference). Equal float frames encode to equal files (0.0). A request batched
# with another differs from diffusers alone in the last float bits; they flip a few 8-bit pixels,
# and the lossy encoder's choices then move whole blocks (seen: 1.02). Another seed's video is ~20
# away (the image conditions both), so the bound is also checked to tell the two apart.
MAX_ROUNDTRIP_DIFF = 3.0


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def source_png(seed: int, size=(40, 24)) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def wait(server, video_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = client(server).videos.retrieve(video_id)
        if v.status in ("completed", "failed"):
            return v
        time.sleep(0.1)
    raise TimeoutError(f"{video_id} unfinished:\n{server.log_tail()}")


def frames_of(mp4: bytes) -> np.ndarray:
    with av.open(io.BytesIO(mp4)) as c:
        return np.stack(
            [f.to_ndarray(format="rgb24").astype(np.float64) for f in c.decode(video=0)]
        )


@functools.cache
def i2v_pipeline(model: str):
    """Loaded once per checkpoint: each comparison runs it for two seeds."""
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(model, png: bytes, size: int, seed: int) -> np.ndarray:
    """diffusers' raw frames of the same request (uint8 RGB, before any encoding)."""
    from diffusers import WanPipeline

    pipe = i2v_pipeline(str(model))

    def embeds(text):
        return WanPipeline._get_t5_prompt_embeds(
            pipe, [text], max_sequence_length=512, device=torch.device("cpu")
        )

    frames = pipe(
        image=Image.open(io.BytesIO(png)).convert("RGB"),
        prompt_embeds=embeds(PROMPT),
        negative_prompt_embeds=embeds(""),
        height=size,
        width=size,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="pil",
    ).frames[0]
    return np.stack([np.asarray(f, dtype=np.float64) for f in frames])


def assert_equals_diffusers(
    served: list[np.ndarray], model, png: bytes, seed: int, fps: int
) -> None:
    """Each served video is diffusers' video of the same request, up to the MP4 encoder."""

    def encoded_reference(seed: int) -> np.ndarray:
        ref = reference(model, png, served[0].shape[2], seed)
        return frames_of(encode_mp4(to_images(ref), fps))

    same_ref, other_ref = encoded_reference(seed), encoded_reference(seed + 100)
    for video in served:
        same, other = np.abs(video - same_ref).mean(), np.abs(video - other_ref).mean()
        assert same <= MAX_ROUNDTRIP_DIFF, (same, other)
        assert same < 0.25 * other, (same, other)  # the bound tells this seed from another


def to_images(frames: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray(f.astype(np.uint8)) for f in frames]


def create(server, png: bytes | None, seed: int, size: str = "32x32", **extra):
    kw = {} if png is None else {"input_reference": ("ref.png", png, "image/png")}
    return client(server).videos.create(
        prompt=PROMPT,
        size=size,
        extra_body={"num_frames": FRAMES, "seed": seed, "num_inference_steps": STEPS, **extra},
        **kw,
    )


def create_json(server, png: bytes, seed: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    body = {
        "prompt": PROMPT,
        "size": "32x32",
        "input_reference": url,
        "num_frames": FRAMES,
        "seed": seed,
        "num_inference_steps": STEPS,
    }
    r = httpx.post(
        f"{server.url}/v1/videos", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_i2v_upload_and_data_url_jobs_equal_diffusers(shared_wan_i2v_server):
    server = shared_wan_i2v_server
    png = source_png(0)
    with ThreadPoolExecutor(2) as pool:  # created together: they share denoising steps
        upload = pool.submit(create, server, png, 1)
        by_url = pool.submit(create_json, server, png, 1)
        ids = [upload.result().id, by_url.result()["id"]]
    videos = []
    for video_id in ids:
        done = wait(server, video_id)
        assert done.status == "completed", done.error
        videos.append(frames_of(client(server).videos.download_content(video_id).read()))
    assert videos[0].shape == (FRAMES, 32, 32, 3)
    # A file and a data: URL make the same request. Whether the two share every denoising step
    # depends on when each reaches the stage, so each is held to diffusers' bound, not to the
    # other bit for bit.
    assert_equals_diffusers(videos, server.model, png, 1, 16)


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def _huge_png() -> bytes:
    """A small PNG file whose header declares 5000x5000 pixels."""
    ihdr = struct.pack(">IIBBBBB", 5000, 5000, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("png", "code"),
    [
        (None, "missing_required_parameter"),  # I2V needs an image
        (b"not an image at all", "invalid_image_format"),
        (_huge_png(), "image_too_large"),  # refused by its header, before a pixel is decoded
        (source_png(0)[:80], "invalid_image"),  # truncated
    ],
)
def test_i2v_bad_references_get_400s_before_any_job(shared_wan_i2v_server, png, code):
    server = shared_wan_i2v_server
    before = len(client(server).videos.list(limit=100).data)
    with pytest.raises(BadRequestError) as exc:
        create(server, png, 0)
    err = exc.value.body
    assert err["param"] == "input_reference" and err["code"] == code, err
    assert len(client(server).videos.list(limit=100).data) == before  # no job was made


def test_i2v_reference_over_the_byte_limit_gets_413(shared_wan_i2v_server):
    big = source_png(0) + b"\0" * (32 << 20)  # MAX_IMAGE_BYTES of the edits route, and more
    with pytest.raises(APIStatusError) as exc:
        create(shared_wan_i2v_server, big, 0)
    assert exc.value.status_code == 413


def test_ti2v_image_to_video_equals_diffusers(shared_wan_ti2v_server):
    server = shared_wan_ti2v_server
    png = source_png(2, (32, 48))
    v = create(server, png, 3)
    done = wait(server, v.id)
    assert done.status == "completed", done.error
    got = frames_of(client(server).videos.download_content(v.id).read())
    assert got.shape == (FRAMES, 32, 32, 3)
    assert_equals_diffusers([got], server.model, png, 3, done.fps)


def test_a_video_that_cannot_fit_the_memory_budget_gets_a_400_naming_it(shared_wan_i2v_server):
    """The server's stage has memory_budget_gb (conftest.py): 65 frames at 256x256 need GiBs of
    VAE activations alone, so the job is refused before it exists, naming the frames and the
    setting; 5 frames at 64x64 are accepted (and deleted)."""
    server = shared_wan_i2v_server
    png = source_png(0)
    before = len(client(server).videos.list(limit=100).data)
    with pytest.raises(BadRequestError) as exc:
        create(server, png, 0, size="256x256", num_frames=65)
    err = exc.value.body
    assert err["param"] == "num_frames" and err["code"] == "request_too_large", err
    assert "memory_budget_gb=0.1" in err["message"] and "65 frames" in err["message"]
    assert len(client(server).videos.list(limit=100).data) == before
    small = create(server, png, 0, size="64x64")
    assert client(server).videos.delete(small.id).deleted
