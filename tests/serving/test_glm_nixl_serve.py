"""GLM-Image served with its AR -> DiT payload over NIXL paints the same image as over shared memory.

`vllm serve TINY_GLM --stage-config glm_image_tiny_nixl` (glm_image_tiny.yaml with its edge 0 -> 1
over a NIXL connector into CPU memory, UCX over loopback), against conftest's session server
(glm_image_tiny.yaml, the shared-memory connector). Both run the AR stage greedy (GREEDY_GLM_OVERRIDES) and get the same
request (same seed, size and steps), so the connector is the only difference: it must deliver
the prior token ids unchanged, and the image must be the same. That it is NIXL that carried them
is read from the stages: both stage processes have NIXL loaded, and the connector counters they
relay to /metrics count one NIXL transfer per request, none failed. Concurrent requests over
NIXL all succeed too.

Over 60 s (the first test's setup): two GLM-Image servers start for it on a 2-core box, the NIXL
one and, unless another module of the worker already started it, the session server.
"""

from __future__ import annotations

import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import psutil
import pytest
from conftest import GREEDY_GLM_OVERRIDES, start_shared
from omni_server import API_KEY
from openai import OpenAI
from PIL import Image

from vllm_omni_plugin.common.messages import ENGINE_METRICS_INTERVAL_S

pytestmark = pytest.mark.slow
SIZE, STEPS, SEED = 64, 2, 5
CONCURRENT = 4
# Mean absolute pixel difference (0-255) allowed between the NIXL and the shared-memory image:
# none. Same weights, greedy AR, same seed, same CPU code and thread count in both servers: the
# only difference is how the (integer) prior token ids cross, so the images are bit-equal
# (measured: 0.0); any difference means the payload changed on the way.
TOLERANCE = 0.0


@pytest.fixture(scope="module")
def nixl_server(tiny_models, tmp_path_factory):
    # conftest's start-up for the shared servers: SHARED_ENV exposes the stage-inspection route
    # (the stages' pids); the AR stage greedy as in shared_glm_server.
    server = start_shared(
        tiny_models("glm-image"),
        "glm_image_tiny_nixl",
        tmp_path_factory.mktemp("glm-nixl-server"),
        "--stage-overrides",
        GREEDY_GLM_OVERRIDES,
    )
    try:
        yield server
    finally:
        server.stop()


def generate(server, seed: int) -> np.ndarray:
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    res = client.images.generate(
        model=server.model,
        prompt="a red cube on a table",
        size=f"{SIZE}x{SIZE}",
        response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": STEPS},
    )
    assert len(res.data) == 1
    image = Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json)))
    assert image.size == (SIZE, SIZE)
    return np.asarray(image.convert("RGB"), dtype=float)


def nixl_loaded(server) -> dict[int, bool]:
    """stage id -> whether that stage's process has NIXL's library mapped."""
    r = httpx.get(
        f"{server.url}/v1/omni/stages", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    r.raise_for_status()
    return {
        s["stage_id"]: any("nixl" in m.path for m in psutil.Process(s["pid"]).memory_maps())
        for s in r.json()["stages"]
    }


def nixl_counter(server, name: str, role: str = "consumer") -> float:
    key = f'{name}{{connector="nixl",role="{role}"}} '
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(key):
            return float(line[len(key) :])
    raise KeyError(f"{key} not in /metrics")


def test_nixl_edge_paints_the_shared_memory_image(nixl_server, shared_glm_server):
    over_shm = generate(shared_glm_server, SEED)
    over_nixl = generate(nixl_server, SEED)
    diff = np.abs(over_nixl - over_shm).mean()
    assert diff <= TOLERANCE, f"mean |NIXL - shm| = {diff:.4f}/255"
    assert np.ptp(over_nixl) > 10  # a painted image, not a flat fill

    assert nixl_loaded(nixl_server) == {0: True, 1: True}
    assert nixl_counter(nixl_server, "omni_connector_transfers_total") == 1
    assert nixl_counter(nixl_server, "omni_connector_failures_total") == 0
    # The discriminator itself: a stage that never made a NIXL connector has no NIXL loaded.
    assert nixl_loaded(shared_glm_server) == {0: False, 1: False}


def test_concurrent_requests_over_nixl(nixl_server):
    before = nixl_counter(nixl_server, "omni_connector_transfers_total")
    with ThreadPoolExecutor(CONCURRENT) as pool:
        images = list(pool.map(lambda s: generate(nixl_server, s), range(1, CONCURRENT + 1)))
    assert len(images) == CONCURRENT  # each a 64x64 image; any 4xx/5xx would have raised
    after = nixl_counter(nixl_server, "omni_connector_transfers_total")
    assert after == before + CONCURRENT
    assert nixl_counter(nixl_server, "omni_connector_failures_total") == 0
    # The producer (AR stage) hears that a handoff completed only after it sent that request's
    # Result; its metrics timer relays the counters, so /metrics catches up with no new request.
    deadline = time.monotonic() + 5 * ENGINE_METRICS_INTERVAL_S
    while time.monotonic() < deadline:
        produced = nixl_counter(nixl_server, "omni_connector_transfers_total", "producer")
        if produced == after:
            break
        time.sleep(0.5)
    assert produced == after, f"producer counted {produced} handoffs, the consumer {after}"
