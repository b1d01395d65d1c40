"""POST /v1/images/edits on `vllm serve TINY --stage-config flux_kontext_tiny.yaml` and
`... qwen_image_edit_plus_tiny.yaml` (conftest's session servers): the official openai client's
`images.edit`, against diffusers' FluxKontextPipeline and QwenImageEditPlusPipeline at their
own defaults (the source images resized to diffusers' areas: Kontext's ~1 MP resolutions,
Edit-Plus's 384x384 for the text encoder and 1024x1024 for the VAE), several source images as
`image[]`, and more images than the model takes answered 400 in OpenAI's error shape before any
stage sees the request.

Tolerance: mean absolute pixel difference 1.0 (0-255 scale; fp32 on both sides). The tiny
models' images differ by far more between source images (checked on the engine:
tests/diffusion/test_flux_kontext.py, test_qwen_image_edit_plus.py).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from omni_server import API_KEY
from openai import BadRequestError, OpenAI
from PIL import Image

pytestmark = pytest.mark.slow
TOLERANCE = 1.0
STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=float)


def png(seed: int, size=(64, 48)) -> bytes:
    """An RGB source with structure (gradients and noise), so the edit depends on it."""
    y, x = np.mgrid[0 : size[1], 0 : size[0]]
    noise = np.random.RandomState(seed).randint(0, 64, (size[1], size[0], 3))
    rgb = (np.stack([x * 4, y * 5, (x + y) * 2], axis=-1) + noise).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def rgb(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def completed(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("omni_stage_requests_completed_total"):
            return float(line.split()[-1])
    raise AssertionError("metric missing")


def refused_before_any_stage(server, images: list[bytes]) -> dict:
    """Send `images` as image[]; the OpenAI error body of the 400."""
    before = completed(server)
    with pytest.raises(BadRequestError) as info:
        client(server).images.edit(
            model=server.model,
            image=[(f"s{i}.png", im, "image/png") for i, im in enumerate(images)],
            prompt="x",
            size="64x64",
        )
    assert info.value.status_code == 400
    err = info.value.body
    assert set(err) == {"message", "type", "param", "code"}, err
    assert completed(server) == before  # no stage ran it
    return err


def test_kontext_edit_and_generation_match_diffusers_and_one_image_only(kontext_server):
    from diffusers import FluxKontextPipeline

    src = png(0)
    res = client(kontext_server).images.edit(
        model=kontext_server.model,
        image=("source.png", src, "image/png"),
        prompt="make the cube red",
        size="64x64",
        extra_body={"seed": 5, "num_inference_steps": STEPS},
    )
    assert res.size == "64x64" and len(res.data) == 1
    pipe = FluxKontextPipeline.from_pretrained(kontext_server.model)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        rgb(src),
        "make the cube red",
        height=64,
        width=64,
        max_area=64 * 64,  # the requested size, exactly (diffusers' default is 1024x1024)
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(5),
    ).images[0]
    assert np.abs(decode(res.data[0].b64_json) - np.asarray(want, dtype=float)).mean() <= TOLERANCE
    err = refused_before_any_stage(kontext_server, [src, src])
    assert (err["code"], err["param"]) == ("too_many_images", "image"), err
    # Without a source image Kontext generates from text (diffusers' image=None), on the
    # generations route.
    res = client(kontext_server).images.generate(
        model=kontext_server.model,
        prompt="a red cube",
        size="64x64",
        extra_body={"seed": 6, "num_inference_steps": STEPS},
    )
    want = pipe(
        None,
        "a red cube",
        height=64,
        width=64,
        max_area=64 * 64,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(6),
    ).images[0]
    assert np.abs(decode(res.data[0].b64_json) - np.asarray(want, dtype=float)).mean() <= TOLERANCE


def test_edit_plus_two_images_match_diffusers_and_five_are_refused(edit_plus_server):
    from diffusers import QwenImageEditPlusPipeline

    from vllm_omni_plugin.diffusion.adapters.qwen_image_edit import load_processor

    sources = [png(1), png(2, (48, 64))]
    res = client(edit_plus_server).images.edit(
        model=edit_plus_server.model,
        image=[(f"s{i}.png", s, "image/png") for i, s in enumerate(sources)],  # image[]
        prompt="the cat on the cube",
        size="64x64",
        extra_body={"seed": 3, "num_inference_steps": STEPS},
    )
    assert res.size == "64x64" and len(res.data) == 1
    folder = edit_plus_server.model
    pipe = QwenImageEditPlusPipeline.from_pretrained(
        folder, processor=load_processor(Path(folder) / "processor")
    )
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        [rgb(s) for s in sources],
        "the cat on the cube",
        height=64,
        width=64,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(3),
    ).images[0]
    assert np.abs(decode(res.data[0].b64_json) - np.asarray(want, dtype=float)).mean() <= TOLERANCE
    err = refused_before_any_stage(edit_plus_server, [png(i) for i in range(5)])
    assert (err["code"], err["param"]) == ("too_many_images", "image"), err
    assert "at most 4" in err["message"]
