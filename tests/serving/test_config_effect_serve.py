"""Configuration effect, end to end: one `vllm serve` of the tiny GLM-Image pipeline with a
non-default value in every owner, read back from the live stages after start-up: the AR engine's
own VllmConfig, the diffusion engine's config, each stage process's environment
(os.environ as the stage reports it), the API server's request limits, and the connector edge's traffic."""

from __future__ import annotations

import base64
import json
import os

import httpx
import psutil
import pytest
from omni_server import API_KEY, REPO, Server
from openai import BadRequestError, OpenAI

pytestmark = pytest.mark.slow

HOST_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

CONFIG = """
base_config: {base}
serving:
  max_n: 2
  max_prompt_chars: 300
  max_negative_prompt_chars: 20
  request_timeout_s: 250
connectors:
  edge_shm:
    type: shm
    options: {{shm_dir: {shm_dir}, lease_s: 120}}
edges:
  - {{from: 0, to: 1, connector: edge_shm}}
stages:
  - stage_id: 0
    devices: "0"
    seed: 1234
    max_num_seqs: 3
    max_num_batched_tokens: 4608
    gpu_memory_utilization: 0.55
    enable_prefix_caching: false
    enforce_eager: true
    env:
      VLLM_CPU_KVCACHE_SPACE: "1"
      OMNI_EFFECT_MARK: ar-stage
    default_sampling_params:
      temperature: 0.7
      top_p: 0.6
      detokenize: false
  - stage_id: 1
    devices: "0"
    max_batch_size: 3
    max_num_inference_steps: 77
    gpu_memory_utilization: 0.5
    request_batch_max_wait_ms: 5
    vae_use_slicing: true
    vae_use_tiling: true
    min_height: 32
    min_width: 64
    max_height: 512
    env:
      OMNI_EFFECT_MARK: dit-stage
    default_sampling_params:
      num_inference_steps: 2
      guidance_scale: 1.5
      height: 64
      width: 64
"""


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    model = tiny_models("glm-image")
    root = tmp_path_factory.mktemp("effect-server")
    (root / "shm").mkdir()
    config = root / "effect.yaml"
    config.write_text(
        CONFIG.format(base=REPO / "stage_configs" / "glm_image_tiny.yaml", shm_dir=root / "shm")
    )
    srv = Server(
        [str(model), "--stage-config", str(config), "--api-key", API_KEY],
        root / "server.log",
        env={"VLLM_OMNI_DESCRIBE_STAGES": "1"},
    )
    try:
        srv.wait_healthy(timeout=420)
        srv.model = str(model)
        yield srv
    finally:
        srv.stop()


def _describe(server) -> dict[int, dict]:
    r = httpx.get(
        f"{server.url}/v1/omni/stages", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
    )
    assert r.status_code == 200, r.text
    return {s["stage_id"]: s for s in r.json()["stages"]}


def test_every_owner_reads_back_from_the_live_stages(server):
    stages = _describe(server)
    ar, dit = stages[0], stages[1]
    assert ar["ready"] and dit["ready"]

    # AR: the engine's own VllmConfig, as vLLM resolved it.
    eff = ar["info"]["effective"]
    assert eff["scheduler_config"]["max_num_seqs"] == 3
    assert eff["scheduler_config"]["max_num_batched_tokens"] == 4608
    assert eff["scheduler_config"]["scheduler_cls"].endswith("OmniARAsyncScheduler")
    assert eff["model_config"]["enforce_eager"] is True
    assert eff["model_config"]["seed"] == 1234
    assert eff["model_config"]["max_model_len"] == 4096  # from the base file
    assert eff["model_config"]["dtype"] == "torch.float32"
    assert eff["cache_config"]["gpu_memory_utilization"] == 0.55
    assert eff["cache_config"]["enable_prefix_caching"] is False
    # vLLM's CPU platform turns the stage's VLLM_CPU_KVCACHE_SPACE=1 into the KV cache size.
    assert eff["cache_config"]["kv_cache_memory_bytes"] == 1 << 30
    assert eff["default_sampling_params"]["temperature"] == 0.7
    assert eff["default_sampling_params"]["top_p"] == 0.6

    # Diffusion: the engine's config and what it did with it.
    eff = dit["info"]["effective"]
    engine = eff["engine"]
    assert (engine["max_batch_size"], engine["max_num_inference_steps"]) == (3, 77)
    assert engine["defaults"] == {
        "num_inference_steps": 2,
        "guidance_scale": 1.5,
        "height": 64,
        "width": 64,
    }
    assert eff["scheduler_max_batch_size"] == 3 and eff["scheduler_max_wait_s"] == 0.005
    assert eff["memory_budget_bytes"] == int(0.5 * HOST_BYTES)
    assert (eff["vae_use_slicing"], eff["vae_use_tiling"]) == (True, True)
    assert (eff["device"], eff["dtype"]) == ("cpu", "torch.float32")
    limits = dit["info"]["limits"]
    assert (limits["min_height"], limits["min_width"], limits["max_height"]) == (32, 64, 512)
    assert (limits["max_steps"], limits["max_batch_size"]) == (77, 3)

    # Placement and env: each stage process's own os.environ, as the stage reports it
    # (/proc/<pid>/environ is overwritten once the stage sets its process title).
    # Names only (values may be secrets): the route never shows an env value, only whether the stage
    # process has the configured one.
    for sid in (0, 1):
        effective = stages[sid]["info"]["effective"]
        assert effective["environ"]["OMNI_EFFECT_MARK"] == "as configured"
        assert effective["environ"]["CUDA_VISIBLE_DEVICES"] == "0"
        # Both differ from the server only in variables read when used: forked, not fresh.
        assert psutil.Process(stages[sid]["pid"]).parent().name() == "omni-fork-server"
    assert ar["info"]["effective"]["environ"]["VLLM_CPU_KVCACHE_SPACE"] == "as configured"
    assert ar["info"]["effective"]["environ"]["OMNI_AR_WORKER_NICE"] == "as configured"
    shown = json.dumps(stages)
    assert all(mark not in shown for mark in ("ar-stage", "dit-stage"))


def test_serving_limits_and_the_connector_edge_act(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=250)
    for extra, param in (
        # GLM-Image takes no negative prompt at all (its length limit: test_request_limits.py)
        ({"negative_prompt": "x" * 21}, "negative_prompt"),
        ({"num_inference_steps": 78}, "num_inference_steps"),  # max_num_inference_steps: 77
    ):
        with pytest.raises(BadRequestError) as info:
            client.images.generate(model=server.model, prompt="a", extra_body=extra)
        assert info.value.body["param"] == param
    with pytest.raises(BadRequestError) as info:
        client.images.generate(model=server.model, prompt="a", n=3)  # serving max_n: 2
    assert info.value.body["param"] == "n"
    with pytest.raises(BadRequestError):
        client.images.generate(model=server.model, prompt="a", size="32x64")  # min_width 64

    res = client.images.generate(
        model=server.model,
        prompt="a lighthouse",
        n=2,
        size="64x64",
        extra_body={"seed": 3},  # GLM-Image takes no negative prompt (refused above)
    )
    assert len(res.data) == 2 and all(base64.b64decode(d.b64_json) for d in res.data)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'omni_connector_puts_total{connector="edge_shm"} 1.0' in metrics
