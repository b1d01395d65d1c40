"""Real `vllm serve` processes for the serving tests (module-scoped: few start-ups)."""

from __future__ import annotations

import pytest
from omni_server import API_KEY, Server


@pytest.fixture(scope="module")
def qwen_server(tiny_models, tmp_path_factory):
    model = tiny_models("qwen-image")
    log = tmp_path_factory.mktemp("qwen-server") / "server.log"
    server = Server(
        [str(model), "--stage-config", "stage_configs/qwen_image_tiny.yaml", "--api-key", API_KEY],
        log,
    )
    try:
        server.startup_s = server.wait_healthy()
        server.model = str(model)
        yield server
    finally:
        server.stop()
