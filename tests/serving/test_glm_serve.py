"""GLM-Image end to end: `vllm serve TINY_GLM --stage-config glm_image_tiny.yaml` runs the AR
stage (a vLLM engine with our model) and the DiT stage in their own processes, the prior
token ids crossing through the shared-memory connector.

The same server (one start-up, ~2 min on 2 CPU cores) then shows the failure paths that always end:

* A stage whose start fails (its process exits during start-up) is killed, logged and retried
  with backoff, at server start and on restart.
* A request that fails or is cancelled after the AR stage produced its payload frees the
  shared-memory file within a second (the connector's lease is 300 s).
* A device error in a diffusion step (a real torch.AcceleratorError, injected through the
  test-only VLLM_OMNI_TEST_DEVICE_ERROR_PROMPT) takes the DiT stage down: 503, restart, and the
  next request succeeds.
* A ValueError from vLLM (an over-long prompt) is a 500, not a 400 blaming `size`.
* A dead vLLM engine core takes the AR stage down (503, restart) instead of failing every request.
* SIGTERM stops the stages concurrently.

The tests run in file order and each leaves the server healthy.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import httpx
import psutil
import pytest
import yaml
from omni_server import API_KEY, REPO, Server, alive
from openai import OpenAI
from PIL import Image

from vllm_omni_plugin.diffusion.runner import FAULT_PROMPT_ENV

pytestmark = pytest.mark.slow

FAULT_PROMPT = "a lighthouse, with an injected device error"
# Makes the stage process exit during start-up while the marker file exists, once per marker:
# a real failing start, with no hook in the product's code.
SITECUSTOMIZE = """
import os
marker = os.environ.get("OMNI_TEST_FAIL_START_MARKER")
if marker and os.path.exists(marker):
    os.unlink(marker)
    os._exit(3)
"""
RETRY_LINE = "start of stage 1 (diffusion) failed (attempt 1), retrying in 1 s"


@pytest.fixture(scope="module")
def glm(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("glm-server")
    shm_dir, hooks = root / "shm", root / "hooks"
    shm_dir.mkdir()
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marker = root / "fail-next-start"
    marker.touch()  # the DiT stage's first start fails
    cfg = yaml.safe_load((REPO / "stage_configs" / "glm_image_tiny.yaml").read_text())
    ar, dit = cfg["stages"]
    ar["max_model_len"] = 1024  # 64x64 needs ~300 tokens; a 4000-char prompt does not fit
    dit["env"] = {
        **(dit.get("env") or {}),
        "PYTHONPATH": str(hooks),
        "OMNI_TEST_FAIL_START_MARKER": str(marker),
        FAULT_PROMPT_ENV: FAULT_PROMPT,
    }
    cfg["connectors"]["shm"]["options"] = {"shm_dir": str(shm_dir)}
    config = root / "glm_image_tiny_faults.yaml"
    config.write_text(yaml.safe_dump(cfg))
    model = tiny_models("glm-image")
    server = Server(
        [str(model), "--stage-config", str(config), "--api-key", API_KEY], root / "server.log"
    )
    try:
        server.wait_healthy(timeout=420)
        server.model, server.shm_dir, server.marker = str(model), shm_dir, marker
        yield server
    finally:
        server.stop()


def post(server, prompt: str = "a lighthouse at dusk", timeout: float = 120) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/images/generations",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": prompt, "size": "64x64", "num_inference_steps": 2, "seed": 1},
        timeout=timeout,
    )


def dit_stage(server) -> psutil.Process:
    return next(
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if "omni-stage-1" in " ".join(p.cmdline())
    )


def payloads(server) -> list[str]:
    return [p.name for p in server.shm_dir.iterdir()]


def wait_for(cond, timeout: float, what: str) -> float:
    """Seconds until `cond()` held; fails after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.02)
    return time.monotonic() - t0


def wait_healthy(server, timeout: float = 180) -> None:
    wait_for(
        lambda: httpx.get(f"{server.url}/health").status_code == 200,
        timeout,
        "server not healthy again",
    )


def test_glm_image_end_to_end(glm):
    titles = [" ".join(p.cmdline()) for p in glm.descendants()]
    assert any("omni-stage-0" in t for t in titles) and any("omni-stage-1" in t for t in titles)
    # vLLM parsed the AR stage's tokenizer folder's config at once, in each of its processes: no
    # failed parse retried after 2 s (stages/tokenizer_folder.py).
    assert "Error parsing config" not in glm.log.read_text(errors="replace")
    client = OpenAI(base_url=f"{glm.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    res = client.images.generate(
        model=glm.model,
        prompt="a lighthouse at dusk",
        size="64x64",
        n=2,
        extra_body={"seed": 7, "num_inference_steps": 2},
    )
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in res.data]
    assert [im.size for im in images] == [(64, 64), (64, 64)]
    # Streamed, same seed (progress as events): the AR stage's token progress, then the DiT's
    # steps with one preview of both images after step 1, then the same two images.
    with httpx.stream(
        "POST",
        f"{glm.url}/v1/images/generations",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "prompt": "a lighthouse at dusk",
            "size": "64x64",
            "n": 2,
            "seed": 7,
            "num_inference_steps": 2,
            "stream": True,
            "partial_images": 1,
            "progress_events": True,
        },
        timeout=300,
    ) as r:
        data = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    kinds = [(d["type"], d.get("stage")) for d in data]
    ar = [d for d in data if d.get("stage") == "ar"]
    assert ar and ar[-1]["step"] <= ar[-1]["total_steps"], kinds
    assert [d["step"] for d in ar] == sorted(d["step"] for d in ar)
    partial = ("image_generation.partial_image", None)
    done = ("image_generation.completed", None)
    dit = ("omni.progress", "diffusion")
    assert kinds[len(ar) :] == [partial, partial, dit, dit, done, done], kinds
    streamed = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in data[-2:]]
    assert [a.tobytes() for a in streamed] == [b.tobytes() for b in images]
    # The DiT's size granularity (32) is enforced in the API server.
    r = httpx.post(
        f"{glm.url}/v1/images/generations",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": "a", "size": "80x64"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "size"
    metrics = httpx.get(f"{glm.url}/metrics").text
    assert (
        'omni_stage_requests_completed_total{kind="ar",pipeline="glm_image",stage_id="0"} 2.0'
        in metrics
    )


def _ar_engine_sample(metrics: str, name: str) -> float | None:
    """A `vllm:` sample of the AR stage's engine as the API server's /metrics shows it, summed
    over vLLM's own labels (e.g. finished_reason); None when absent."""
    found = None
    for line in metrics.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and 'stage_id="0"' in head and 'stage="ar"' in head:
            found = (found or 0.0) + float(value)
    return found


def test_ar_engine_metrics_reach_metrics_labelled_by_stage(glm):
    # vLLM's own engine metrics live in the AR stage's process; the stage sends them every 2 s
    # and /metrics shows them under vLLM's names with stage_id/stage labels, beside ours.
    from vllm_omni_plugin.families.glm_image.processing import num_image_tokens

    def scrape() -> str:
        return httpx.get(f"{glm.url}/metrics", timeout=10).text

    tokens = "vllm:generation_tokens_total"

    def count() -> float | None:
        return _ar_engine_sample(scrape(), tokens)

    def settled() -> float:
        # Earlier tests' tokens may still be on their way (the stage sends every 2 s): wait
        # until two readings one interval apart agree.
        previous = count()
        while True:
            time.sleep(2.5)
            now = count()
            if now == previous:
                return now
            previous = now

    wait_for(lambda: count() is not None, 30, "no vllm: metrics")
    before = settled()
    assert post(glm).status_code == 200
    # One 64x64 request: the preview and large grids' codes, then EOS.
    want = before + num_image_tokens(64, 64) + 1
    wait_for(lambda: count() >= want, 30, "token count not updated")
    assert settled() == want
    after = scrape()
    done = _ar_engine_sample(after, "vllm:request_success_total")
    assert done is not None and done >= 1
    assert _ar_engine_sample(after, "vllm:num_requests_running") == 0.0
    assert "omni_stage_up{" in after  # ours are still there
    # Only the AR stage runs a vLLM engine: nothing is labelled with the DiT stage.
    assert not [x for x in after.splitlines() if x.startswith("vllm:") and 'stage_id="1"' in x]


def test_official_client_streams_glm_image(glm):
    """The issue's acceptance call on GLM-Image: two previews from the DiT, then the image the
    same request gives without streaming."""
    client = OpenAI(base_url=f"{glm.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    kwargs = dict(model=glm.model, prompt="a red door", size="64x64")
    extra = {"seed": 3, "num_inference_steps": 3}
    events = list(client.images.generate(**kwargs, stream=True, partial_images=2, extra_body=extra))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + [
        "image_generation.completed"
    ]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    plain = client.images.generate(**kwargs, extra_body=extra).data[0].b64_json
    assert base64.b64decode(events[-1].b64_json) == base64.b64decode(plain)


def test_failed_start_is_killed_logged_and_retried(glm):
    assert RETRY_LINE in glm.log.read_text()
    assert not glm.marker.exists()
    assert post(glm).status_code == 200
    assert not payloads(glm)  # the DiT read and released the AR's payload


def test_client_disconnect_between_stages_frees_the_payload(glm):
    dit = dit_stage(glm)
    dit.suspend()  # the DiT cannot read the payload: only a release can remove it
    try:
        body = json.dumps({"prompt": "a red door", "size": "64x64", "num_inference_steps": 2})
        head = (
            f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", glm.port)) as sock:
            sock.sendall(head.encode() + body.encode())
            wait_for(lambda: payloads(glm), 120, "the AR stage produced no payload")
        took = wait_for(lambda: not payloads(glm), 1.0, f"payload still there: {payloads(glm)}")
        print(f"payload released {took:.3f} s after the client went away")
    finally:
        dit.resume()
    assert post(glm).status_code == 200


def test_dead_consumer_frees_the_payload_and_its_failed_restart_is_retried(glm):
    glm.marker.touch()  # the DiT's next start fails once
    dit = dit_stage(glm)
    dit.suspend()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=post(glm, "a blue boat")))
    thread.start()
    try:
        wait_for(lambda: payloads(glm), 120, "the AR stage produced no payload")
    finally:
        dit.kill()
    thread.join(30)
    r = result["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "stage_unavailable", r.text
    wait_for(lambda: not payloads(glm), 1.0, f"payload still there: {payloads(glm)}")
    wait_healthy(glm)
    assert glm.log.read_text().count(RETRY_LINE) == 2
    assert not glm.marker.exists()
    assert post(glm).status_code == 200


def test_device_error_takes_the_stage_down_and_it_comes_back(glm):
    r = post(glm, FAULT_PROMPT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "stage_unavailable", r.text
    log = glm.log.read_text()
    assert "AcceleratorError" in log and "stage 1 (diffusion) died with exit code 70" in log
    wait_healthy(glm)
    assert post(glm).status_code == 200
    metrics = httpx.get(f"{glm.url}/metrics").text
    assert 'omni_stage_deaths_total{kind="diffusion",pipeline="glm_image",stage_id="1"} 2.0' in (
        metrics
    )


def test_value_error_from_vllm_is_not_a_bad_size(glm):
    # ~4000 characters of distinct words: far more tokens than max_model_len (1024), which
    # vLLM refuses with a ValueError. Not the client's `size`, and not ours to call a 400.
    prompt = " ".join(f"w{i}x" for i in range(800))[:3990]
    r = post(glm, prompt)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["param"] is None and err["code"] == "stage_error", err
    assert post(glm).status_code == 200


def test_dead_vllm_engine_takes_the_ar_stage_down_and_it_comes_back(glm):
    """Close to 60 s on 2 cores: the AR stage is restarted for real, a new vLLM engine core
    and worker included, and the test waits until it serves again."""
    # vLLM's engine core dies (as after a CUDA error): the AR stage must not stay "ready" and
    # fail every request; it exits within seconds, requests get 503, and it is restarted.
    ar = next(
        p
        for p in psutil.Process(glm.proc.pid).children(recursive=True)
        if "omni-stage-0" in " ".join(p.cmdline())
    )
    next(p for p in ar.children(recursive=True) if "EngineCore" in p.name()).kill()
    wait_for(lambda: httpx.get(f"{glm.url}/health").status_code != 200, 20, "AR stage still ready")
    r = post(glm)
    assert r.status_code == 503 and r.json()["error"]["code"] == "stage_unavailable", r.text
    wait_healthy(glm, 300)
    assert post(glm).status_code == 200
    assert "stage 0 (ar) died with exit code 1" in glm.log.read_text()
    # Forked again by the server's fork server, as at its first start.
    restarted = next(
        p
        for p in psutil.Process(glm.proc.pid).children(recursive=True)
        if "omni-stage-0" in " ".join(p.cmdline())
    )
    assert restarted.pid != ar.pid and restarted.parent().name() == "omni-fork-server"


def test_sigterm_stops_stages_concurrently(glm):
    # Both stages frozen: each one's stop waits out its polite 5 s and its SIGTERM's 2 s before
    # SIGKILL. One after the other that is over 14 s; together about 7 s.
    stages = [
        p
        for p in psutil.Process(glm.proc.pid).children(recursive=True)
        if "omni-stage-" in " ".join(p.cmdline())
    ]
    assert len(stages) == 2
    everything = glm.descendants()
    for p in stages:
        p.suspend()
    t0 = time.monotonic()
    glm.stop()
    took = time.monotonic() - t0
    assert took < 12, f"shutdown took {took:.1f} s"
    # Killed processes leave once the kernel has torn them down; one that was not killed stays.
    wait_for(
        lambda: not [p.pid for p in everything if alive(p)], 10, "a process outlived its server"
    )
