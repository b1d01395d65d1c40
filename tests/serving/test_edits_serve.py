"""POST /v1/images/edits on `vllm serve TINY_QWEN_IMAGE_EDIT --stage-config
qwen_image_edit_tiny.yaml`: the official openai client's `images.edit`, against diffusers'
QwenImageEditPipeline at its own defaults (the source image conditioned at 1024x1024 pixels),
streaming with `image_edit.*` events, and bad uploads answered 4xx before any stage.

The session's shared Qwen-Image-Edit server (also test_lora_serve.py's and
test_request_fields_serve.py's). Each edit costs several seconds on a CPU (the 1 MP condition image
goes through the tiny VAE encoder, vision tower and transformer), so the module runs three.
"""

from __future__ import annotations

import base64
import io
import os

import httpx
import numpy as np
import pytest
from omni_server import API_KEY
from openai import BadRequestError, OpenAI
from PIL import Image

from vllm_omni_plugin.serving.edits import MAX_EDIT_BODY_BYTES

pytestmark = pytest.mark.slow
PROMPT = "make the cube blue"
TOLERANCE = 1.0  # mean absolute pixel difference, 0-255 scale (fp32 on both sides)


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=float)


def source_png() -> bytes:
    """A 48x64 RGB source with structure (gradients), so the edit depends on it."""
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def edit_server(shared_edit_server):
    """The session's Qwen-Image-Edit server (conftest.py): the bundled CPU config. Its LoRA
    adapters are only loaded for requests that name one, which none here does."""
    return shared_edit_server


def reference(model_dir, image: bytes, seed: int) -> np.ndarray:
    import torch
    from diffusers import QwenImageEditPipeline

    from vllm_omni_plugin.diffusion.adapters.qwen_image_edit import load_processor

    pipe = QwenImageEditPipeline.from_pretrained(
        str(model_dir), processor=load_processor(model_dir / "processor")
    )
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        Image.open(io.BytesIO(image)).convert("RGB"),
        PROMPT,
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(seed),
    )
    return np.asarray(out.images[0], dtype=float)


def test_openai_client_edit_matches_diffusers(edit_server, tiny_models, tmp_path):
    src = source_png()
    path = tmp_path / "source.png"
    path.write_bytes(src)
    with open(path, "rb") as f:
        res = client(edit_server).images.edit(
            model=edit_server.model,
            image=f,
            prompt=PROMPT,
            size="64x64",
            extra_body={"seed": 5, "num_inference_steps": 2},
        )
    assert res.size == "64x64" and len(res.data) == 1
    got = decode(res.data[0].b64_json)
    assert got.shape == (64, 64, 3)
    want = reference(tiny_models("qwen-image-edit"), src, seed=5)
    assert np.abs(got - want).mean() <= TOLERANCE


def test_an_edit_batched_with_others_equals_it_alone(edit_server):
    # Three edits at once share the stage's steps (step-level batching); each must be the
    # image it is alone: the same seed gives the same picture, other seeds other pictures.
    from concurrent.futures import ThreadPoolExecutor

    def one(seed: int) -> np.ndarray:
        res = client(edit_server).images.edit(
            model=edit_server.model,
            image=("source.png", source_png(), "image/png"),
            prompt=PROMPT,
            size="64x64",
            extra_body={"seed": seed, "num_inference_steps": 2},
        )
        return decode(res.data[0].b64_json)

    alone = one(6)
    with ThreadPoolExecutor(3) as pool:
        batched = list(pool.map(one, (5, 6, 7)))
    assert np.abs(batched[1] - alone).mean() <= TOLERANCE
    assert np.abs(batched[0] - batched[2]).mean() > 0


def test_stream_uses_image_edit_events(edit_server):
    stream = client(edit_server).images.edit(
        model=edit_server.model,
        image=[("source.png", source_png(), "image/png")],  # sent as image[]
        prompt=PROMPT,  # no size: the source's 4:3 at the stage's 64x64 area, height >= 64
        stream=True,
        partial_images=1,
        extra_body={"seed": 9, "num_inference_steps": 2},
    )
    events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert events[0].partial_image_index == 0
    assert all(e.size == "80x64" for e in events)
    assert decode(events[-1].b64_json).shape == (64, 80, 3)


def _png(size, mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size).save(out, format="PNG")
    return out.getvalue()


def _bad_uploads() -> list[tuple[str, dict, dict, int, str]]:
    """(case, files, form fields, status, OpenAI error code)."""
    good = source_png()
    huge = _png((10000, 10000), "1")  # 100 MP declared in a few KB
    many = [("image[]", ("s.png", good, "image/png"))] * 20
    mask = _png((64, 48), "RGBA")
    return [
        (
            "not an image",
            {"image": ("a.png", b"hello, not a png", "image/png")},
            {},
            400,
            "invalid_image_format",
        ),
        (
            "truncated png",
            {"image": ("t.png", good[: len(good) // 2], "image/png")},
            {},
            400,
            "invalid_image",
        ),
        ("100 MP", {"image": ("h.png", huge, "image/png")}, {}, 400, "image_too_large"),
        ("20 images", many, {}, 400, "too_many_images"),
        (
            "wrong field name",
            {"images": ("s.png", good, "image/png")},
            {},
            400,
            "unknown_parameter",
        ),
        (
            "mask",
            {"image": ("s.png", good, "image/png"), "mask": ("m.png", mask, "image/png")},
            {},
            400,
            "unsupported_parameter",
        ),
        (
            "no prompt",
            {"image": ("s.png", good, "image/png")},
            {"prompt": None},
            400,
            "missing_required_parameter",
        ),
        ("bad n", {"image": ("s.png", good, "image/png")}, {"n": "two"}, 400, "invalid_type"),
        ("gif", {"image": ("g.gif", _gif(), "image/gif")}, {}, 400, "invalid_image_format"),
    ]


def _gif() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="GIF")
    return out.getvalue()


def test_bad_uploads_are_4xx_before_any_stage(edit_server):
    def completed() -> float:
        for line in httpx.get(f"{edit_server.url}/metrics").text.splitlines():
            if line.startswith("omni_stage_requests_completed_total"):
                return float(line.split()[-1])
        raise AssertionError("metric missing")

    before = completed()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for case, files, fields, status, code in _bad_uploads():
        data = {"prompt": PROMPT, **fields}
        data = {k: v for k, v in data.items() if v is not None}
        files = list(files.items()) if isinstance(files, dict) else files
        r = httpx.post(
            f"{edit_server.url}/v1/images/edits",
            headers=headers,
            data=data,
            files=files or None,
            timeout=60,
        )
        assert r.status_code == status, (case, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (case, err)
        assert err["code"] == code and err["type"] == "invalid_request_error", (case, err)
    # A body over the route's limit is refused while it is read (413).
    r = httpx.post(
        f"{edit_server.url}/v1/images/edits",
        headers={**headers, "content-type": "multipart/form-data; boundary=x"},
        content=b"x" * (MAX_EDIT_BODY_BYTES + 1),
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    # A JSON body is not an edit; the openai client's own call with a bad file is a 400 too.
    r = httpx.post(f"{edit_server.url}/v1/images/edits", headers=headers, json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    with pytest.raises(BadRequestError):
        client(edit_server).images.edit(
            model=edit_server.model, image=("x.png", b"\x89PNG\r\n\x1a\n", "image/png"), prompt="x"
        )
    # Text-to-image on an edit-only pipeline (its topology requires a source image).
    with pytest.raises(BadRequestError):
        client(edit_server).images.generate(model=edit_server.model, prompt="x", size="64x64")
    assert completed() == before


def test_a_source_with_a_4_mib_icc_profile_is_edited_like_one_without(edit_server):
    """A JPEG carrying a 4 MiB ICC profile (more than a PNG reader accepts in one chunk) is
    converted at the route without its profile: the stage edits it (200), the same image as the
    same pixels without a profile."""
    rgb = Image.open(io.BytesIO(source_png())).convert("RGB")
    plain, tagged = io.BytesIO(), io.BytesIO()
    rgb.save(plain, format="JPEG", quality=95)
    rgb.save(tagged, format="JPEG", quality=95, icc_profile=os.urandom(4 << 20))
    assert len(tagged.getvalue()) > 4 << 20

    def edit(data: bytes) -> np.ndarray:
        res = client(edit_server).images.edit(
            model=edit_server.model,
            image=("src.jpg", data, "image/jpeg"),
            prompt=PROMPT,
            size="64x64",
            extra_body={"seed": 5, "num_inference_steps": 2},
        )
        return decode(res.data[0].b64_json)

    assert np.array_equal(edit(tagged.getvalue()), edit(plain.getvalue()))
