"""GLM-Image image-to-image served: `client.images.edit` on `vllm serve TINY_GLM --stage-config
glm_image_tiny.yaml` (conftest's shared server: the AR stage greedy through `--stage-overrides`,
so that transformers can be the reference), against transformers' AR + diffusers' GlmImagePipeline assembled by hand on the same
weights and seed (diffusers 0.42.1 cannot run its own image-to-image AR step: see
tests/diffusion/test_glm_image_i2i.py), alone and while text-to-image requests run beside it.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from omni_server import API_KEY
from openai import BadRequestError, OpenAI
from PIL import Image

pytestmark = pytest.mark.slow
PROMPT = "make the cube blue"
SIZE = 64
STEPS = 2
# Mean absolute pixel difference, 0-255 scale (fp32 on both sides; the DiT alone measures 0.0).
TOLERANCE = 1.0


def source_png() -> bytes:
    """96x64 with structure (sides multiples of 32: the stages keep it as it is)."""
    y, x = np.mgrid[0:64, 0:96]
    rgb = np.stack([x * 2, y * 3, (x + y) * 2], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=float)


@pytest.fixture(scope="module")
def server(shared_glm_server):
    # conftest's session GLM server (its AR stage greedy): no start-up of our own. Shared with
    # other modules: read it, never change its attributes.
    return shared_glm_server


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def edit(server, seed: int) -> np.ndarray:
    res = client(server).images.edit(
        model=str(server.model),
        image=("source.png", source_png(), "image/png"),
        prompt=PROMPT,
        size=f"{SIZE}x{SIZE}",
        extra_body={"seed": seed, "num_inference_steps": STEPS},
    )
    assert len(res.data) == 1
    return decode(res.data[0].b64_json)


def reference(model_dir, seed: int) -> np.ndarray:
    """transformers' greedy AR on the processor's image + text inputs (the target grid, the
    source codes), upsampled as diffusers does; then diffusers' pipeline with those ids."""
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    image = Image.open(io.BytesIO(source_png())).convert("RGB")
    ar, processor = pipe.vision_language_encoder, pipe.processor
    content = [{"type": "image", "image": image}, {"type": "text", "text": PROMPT}]
    inputs = processor.apply_chat_template(
        [[{"role": "user", "content": content}]],
        tokenize=True,
        target_h=SIZE,
        target_w=SIZE,
        return_dict=True,
        return_tensors="pt",
    )
    rows = cols = SIZE // 32
    with torch.no_grad():
        out = ar.generate(**inputs, max_new_tokens=rows * cols + 1, do_sample=False)
        target = out[0, inputs["input_ids"].shape[1] :][: rows * cols]
        grid = inputs["image_grid_thw"][:1]
        feats = ar.model.get_image_features(inputs["pixel_values"], grid).pooler_output
        codes = ar.model.get_image_tokens(feats)
    up = pipe._upsample_token_ids
    big = grid.clone()
    big[:, 1:] *= 2
    images = pipe(
        PROMPT,
        image=[image],
        prior_token_ids=up(target, rows, cols),
        prior_token_image_ids=[up(codes, int(grid[0, 1]), int(grid[0, 2]))[0]],
        source_image_grid_thw=[big],
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=1.5,  # glm_image_tiny.yaml's default
        generator=torch.Generator("cpu").manual_seed(seed),
    ).images
    return np.asarray(images[0], dtype=float)


def ar_completed(server) -> float:
    key = 'omni_stage_requests_completed_total{kind="ar",pipeline="glm_image",stage_id="0"} '
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(key):
            return float(line[len(key) :])
    return 0.0


def test_openai_client_edit_matches_the_reference_alone_and_beside_generations(server):
    alone = edit(server, seed=3)
    assert alone.shape == (SIZE, SIZE, 3)
    want = reference(server.model, seed=3)
    diff = np.abs(alone - want).mean()
    assert diff <= TOLERANCE, diff

    def generate(seed: int):
        return client(server).images.generate(
            model=str(server.model),
            prompt="a red cube",
            size=f"{SIZE}x{SIZE}",
            extra_body={"seed": seed, "num_inference_steps": STEPS},
        )

    with ThreadPoolExecutor(3) as pool:
        gens = [pool.submit(generate, s) for s in (1, 2)]
        beside = pool.submit(edit, server, 3)
        assert all(len(g.result().data) == 1 for g in gens)
        diff = np.abs(beside.result() - want).mean()
        assert diff <= TOLERANCE, diff


def test_glm_edit_refusals_before_any_stage(server):
    """One source image and no mask for GLM-Image: 400s from the API server."""
    before = ar_completed(server)
    with pytest.raises(BadRequestError) as e:
        client(server).images.edit(
            model=str(server.model),
            image=[("a.png", source_png(), "image/png"), ("b.png", source_png(), "image/png")],
            prompt=PROMPT,
            size=f"{SIZE}x{SIZE}",
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "image"
    mask = io.BytesIO()
    Image.new("RGBA", (96, 64)).save(mask, format="PNG")
    with pytest.raises(BadRequestError) as e:
        client(server).images.edit(
            model=str(server.model),
            image=("a.png", source_png(), "image/png"),
            mask=("m.png", mask.getvalue(), "image/png"),
            prompt=PROMPT,
            size=f"{SIZE}x{SIZE}",
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "mask"
    assert ar_completed(server) == before  # nothing reached the AR stage
