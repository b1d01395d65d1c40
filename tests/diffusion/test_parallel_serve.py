"""`vllm serve` on the tiny GLM-Image with `--stage-overrides '{"1": {"cfg_parallel": true}}'`:
the DiT stage runs as two gloo ranks (its own process and one follower), serves the official
client, and when the follower dies the stage goes down as a whole (exit 71) and comes back with
two fresh ranks, giving the same images for the same seed."""

from __future__ import annotations

import base64
import io
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from omni_server import API_KEY, REPO, Server  # noqa: E402

pytestmark = pytest.mark.slow

FOLLOWER = "vllm_omni_plugin.diffusion.parallel.follower"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("glm-cfg-parallel")
    model = tiny_models("glm-image")
    srv = Server(
        [
            str(model),
            "--stage-config",
            str(REPO / "stage_configs" / "glm_image_tiny.yaml"),
            "--stage-overrides",
            '{"1": {"cfg_parallel": true}}',
            "--api-key",
            API_KEY,
        ],
        root / "server.log",
    )
    try:
        srv.wait_healthy(timeout=420)
        srv.model = str(model)
        yield srv
    finally:
        srv.stop()


def _cmdline(p: psutil.Process) -> str:
    """A process's command line; "" for one that exited (a zombie until reaped) meanwhile."""
    try:
        return " ".join(p.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ""


def dit_ranks(srv) -> tuple[psutil.Process | None, list[psutil.Process]]:
    """(the DiT stage process, its follower ranks); (None, []) while the stage is respawning."""
    stage = next(
        (
            p
            for p in psutil.Process(srv.proc.pid).children(recursive=True)
            if "omni-stage-1" in _cmdline(p)
        ),
        None,
    )
    if stage is None:
        return None, []
    try:
        followers = [p for p in stage.children() if FOLLOWER in _cmdline(p)]
    except psutil.NoSuchProcess:  # it died between the two reads
        return None, []
    return stage, followers


def generate(srv) -> list[bytes]:
    client = OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    res = client.images.generate(
        model=srv.model,
        prompt='a sign saying "open"',  # quoted glyph text: cond and uncond forwards differ
        size="64x64",
        n=2,
        extra_body={"seed": 11, "num_inference_steps": 2, "guidance_scale": 1.5},
    )
    images = [base64.b64decode(d.b64_json) for d in res.data]
    for raw in images:
        assert Image.open(io.BytesIO(raw)).size == (64, 64)
    return images


def test_cfg_parallel_serves_on_two_ranks_and_restarts_as_a_whole(server):
    stage, followers = dit_ranks(server)
    assert len(followers) == 1  # rank 1; rank 0 is the stage process itself
    first = generate(server)
    assert len(first) == 2 and first[0] != first[1]

    followers[0].kill()
    t0 = time.monotonic()
    while stage.is_running() and stage.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() - t0 < 20, "the stage outlived its dead rank"
        time.sleep(0.1)
    deadline = time.monotonic() + 300
    while httpx.get(f"{server.url}/health").status_code != 200 or len(dit_ranks(server)[1]) != 1:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.5)
    assert "stage 1 (diffusion) died with exit code 71" in server.log.read_text()
    new_stage, _ = dit_ranks(server)
    assert new_stage is not None and new_stage.pid != stage.pid
    assert generate(server) == first  # fresh ranks, same seed: the same images
