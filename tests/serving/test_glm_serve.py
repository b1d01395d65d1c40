"""GLM-Image end to end: `vllm serve TINY_GLM --stage-config glm_image_tiny.yaml` runs the AR
stage (a vLLM engine with our model) and the DiT stage in their own processes, the prior
token ids crossing through the shared-memory connector."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from omni_server import API_KEY, Server
from openai import OpenAI
from PIL import Image

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def glm_server(tiny_models, tmp_path_factory):
    model = tiny_models("glm-image")
    log = tmp_path_factory.mktemp("glm-server") / "server.log"
    server = Server(
        [str(model), "--stage-config", "stage_configs/glm_image_tiny.yaml", "--api-key", API_KEY],
        log,
    )
    try:
        server.wait_healthy(timeout=420)
        server.model = str(model)
        yield server
    finally:
        server.stop()


def test_glm_image_end_to_end(glm_server):
    titles = [" ".join(p.cmdline()) for p in glm_server.descendants()]
    assert any("omni-stage-0" in t for t in titles) and any("omni-stage-1" in t for t in titles)
    client = OpenAI(base_url=f"{glm_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    res = client.images.generate(
        model=glm_server.model,
        prompt="a lighthouse at dusk",
        size="64x64",
        n=2,
        extra_body={"seed": 7, "num_inference_steps": 2},
    )
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in res.data]
    assert [im.size for im in images] == [(64, 64), (64, 64)]
    # The DiT's size granularity (32) is enforced in the API server.
    r = httpx.post(
        f"{glm_server.url}/v1/images/generations",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": "a", "size": "80x64"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "size"
    metrics = httpx.get(f"{glm_server.url}/metrics").text
    assert (
        'omni_stage_requests_completed_total{kind="ar",pipeline="glm_image",stage_id="0"} 1.0'
        in metrics
    )
