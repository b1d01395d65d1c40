"""Real `vllm serve` processes for the serving tests (module-scoped: few start-ups)."""

from __future__ import annotations

import pytest
from omni_server import API_KEY, REPO, REQUEST_TIMEOUT_S, Server


@pytest.fixture(scope="module")
def qwen_server(tiny_models, tmp_path_factory):
    model = tiny_models("qwen-image")
    root = tmp_path_factory.mktemp("qwen-server")
    # The bundled CPU config plus a short serving.request_timeout_s, which one test exceeds.
    config = root / "qwen_image_tiny_timeout.yaml"
    config.write_text(
        f"base_config: {REPO / 'stage_configs' / 'qwen_image_tiny.yaml'}\n"
        f"serving:\n  request_timeout_s: {REQUEST_TIMEOUT_S}\n"
    )
    server = Server(
        [str(model), "--stage-config", str(config), "--api-key", API_KEY], root / "server.log"
    )
    try:
        server.startup_s = server.wait_healthy()
        server.model = str(model)
        yield server
    finally:
        server.stop()
