"""Z-Image-Turbo and FLUX.2 klein served by `vllm serve TINY_DIR --stage-config ...`, through
the official openai client: images equal diffusers' pipelines on the same tiny checkpoint and
seed (tolerance: mean absolute pixel difference <= 1.0 on the 0-255 scale, fp32 on both sides;
<= 0.02 for edits, as the tiny transformer's reference images move its picture by only ~0.4:
see tests/diffusion/test_flux2_klein.py), and the fields a family does not apply answered 400
naming them.

Z-Image's server is started with `--stage-config auto` (its model_index.json picks
z_image_tiny.yaml); FLUX.2 klein's with flux2_klein_tiny.yaml, on both image routes.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from omni_server import API_KEY
from openai import BadRequestError, OpenAI
from PIL import Image

pytestmark = pytest.mark.slow
TOLERANCE = 1.0
EDIT_TOLERANCE = 0.02
SIZE = 32


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=float)


def generate(server, **extra) -> np.ndarray:
    res = client(server).images.generate(
        model=server.model,
        prompt="a red cube",
        size=f"{SIZE}x{SIZE}",
        extra_body={"seed": 3, "num_inference_steps": 2, **extra},
    )
    assert len(res.data) == 1
    return decode(res.data[0].b64_json)


def source_png(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def refused_param(call) -> str | None:
    with pytest.raises(BadRequestError) as info:
        call()
    return info.value.body.get("param") if isinstance(info.value.body, dict) else None


def test_z_image_auto_config_generation_matches_diffusers(z_image_server):
    from diffusers import ZImagePipeline

    got = generate(z_image_server)
    pipe = ZImagePipeline.from_pretrained(z_image_server.model)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        "a red cube",
        guidance_scale=0.0,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(3),
    ).images[0]
    assert np.abs(got - np.asarray(want, dtype=float)).mean() <= TOLERANCE
    assert refused_param(lambda: generate(z_image_server, guidance_scale=4.0)) == "guidance_scale"


def test_flux2_klein_generation_and_edit_match_diffusers(flux2_klein_server):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(flux2_klein_server.model)
    pipe.set_progress_bar_config(disable=True)

    def reference(images=None) -> np.ndarray:
        out = pipe(
            image=images,
            prompt="a red cube",
            height=SIZE,
            width=SIZE,
            num_inference_steps=2,
            generator=torch.Generator("cpu").manual_seed(3),
        )
        return np.asarray(out.images[0], dtype=float)

    got = generate(flux2_klein_server)  # guidance 4.0 (diffusers' default): CFG runs
    assert np.abs(got - reference()).mean() <= TOLERANCE

    sources = [source_png(1), source_png(2)]
    res = client(flux2_klein_server).images.edit(
        model=flux2_klein_server.model,
        image=[(f"s{i}.png", png, "image/png") for i, png in enumerate(sources)],  # image[]
        prompt="a red cube",
        size=f"{SIZE}x{SIZE}",
        extra_body={"seed": 3, "num_inference_steps": 2},
    )
    edited = decode(res.data[0].b64_json)
    images = [Image.open(io.BytesIO(png)).convert("RGB") for png in sources]
    assert np.abs(edited - reference(images)).mean() <= EDIT_TOLERANCE
    assert np.abs(edited - got).mean() > 2 * EDIT_TOLERANCE  # the references changed it

    negative = lambda: generate(flux2_klein_server, negative_prompt="blurry")  # noqa: E731
    assert refused_param(negative) == "negative_prompt"
