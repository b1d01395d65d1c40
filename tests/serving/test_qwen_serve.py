"""`vllm serve TINY_QWEN --stage-config qwen_image_tiny.yaml`: a real server with a real
diffusion-stage process, driven by the official openai client.

One server for the module (start-up ~30 s). Order matters: the stage-kill and SIGTERM tests
run last.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import psutil
import pytest
from omni_server import (
    API_KEY,
    MULTIPART_FILE_START,
    OTHER_KEY,
    QWEN_MAX_BATCH,
    QWEN_MAX_QUEUED,
    REQUEST_TIMEOUT_S,
    alive,
    send_chunked,
)
from openai import OpenAI
from PIL import Image

pytestmark = pytest.mark.slow
PROMPT = "a red bicycle in the snow"
# How long a stage may take to end after its server did (test_shutdown_serve.py's bound).
ORPHAN_BOUND_S = 10.0


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def decode(b64: str) -> np.ndarray:
    return np.asarray(
        Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float64
    )


def generate(server, seed: int, **kw) -> list[np.ndarray]:
    res = client(server).images.generate(
        model=server.model,
        prompt=kw.pop("prompt", PROMPT),
        size=kw.pop("size", "64x64"),
        n=kw.pop("n", 1),
        response_format="b64_json",
        extra_body={"seed": seed, "num_inference_steps": 2, **kw},
    )
    return [decode(d.b64_json) for d in res.data]


@pytest.fixture(scope="module")
def reference(tiny_models):
    """diffusers' own QwenImagePipeline on the same tiny weights."""
    import torch
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(
        str(tiny_models("qwen-image")), torch_dtype=torch.float32
    )

    def run(seed: int, size=(64, 64), n: int = 1) -> list[np.ndarray]:
        images = pipe(
            PROMPT,
            width=size[0],
            height=size[1],
            num_inference_steps=2,
            num_images_per_prompt=n,
            generator=torch.Generator("cpu").manual_seed(seed),
        ).images
        return [np.asarray(im.convert("RGB"), dtype=np.float64) for im in images]

    return run


def test_models_health_metrics(qwen_server):
    models = client(qwen_server).models.list()
    assert [m.id for m in models.data] == [qwen_server.model]
    assert httpx.get(f"{qwen_server.url}/health").status_code == 200
    metrics = httpx.get(f"{qwen_server.url}/metrics").text
    assert 'omni_stage_up{kind="diffusion",pipeline="qwen_image",stage_id="0"} 1.0' in metrics
    assert "http_requests_total" in metrics  # vLLM's own instrumentation is still there


def test_image_matches_diffusers(qwen_server, reference):
    served = generate(qwen_server, seed=3)
    assert len(served) == 1 and served[0].shape == (64, 64, 3)
    diff = np.abs(served[0] - reference(3)[0]).mean()
    assert diff <= 1.0, f"mean abs pixel diff {diff}"
    # n=2 at a non-square size: two images, both equal to diffusers' num_images_per_prompt=2.
    served = generate(qwen_server, seed=5, n=2, size="96x64")
    ref = reference(5, size=(96, 64), n=2)
    assert [im.shape for im in served] == [(64, 96, 3)] * 2
    assert max(np.abs(a - b).mean() for a, b in zip(served, ref, strict=True)) <= 1.0


def test_concurrent_requests_match_their_solo_images(qwen_server, reference):
    seeds = [11, 12, 13, 14]
    with ThreadPoolExecutor(len(seeds)) as pool:
        images = list(pool.map(lambda s: generate(qwen_server, seed=s)[0], seeds))
    for seed, image in zip(seeds, images, strict=True):
        assert np.abs(image - reference(seed)[0]).mean() <= 1.0, seed


def test_url_format_and_output_formats(qwen_server):
    res = client(qwen_server).images.generate(
        prompt=PROMPT, size="64x64", response_format="url", extra_body={"output_format": "webp"}
    )
    url = res.data[0].url
    assert url.startswith(qwen_server.url + "/v1/images/files/")
    assert httpx.get(url).status_code == 401  # --api-key protects our routes too
    got = httpx.get(url, headers=auth())
    assert got.status_code == 200 and got.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(got.content)).size == (64, 64)
    jpeg = httpx.post(
        f"{qwen_server.url}/v1/images/generations",
        headers=auth(),
        json={"prompt": PROMPT, "output_format": "jpeg", "seed": 1},
        timeout=60,
    ).json()
    assert Image.open(io.BytesIO(base64.b64decode(jpeg["data"][0]["b64_json"]))).format == "JPEG"
    assert httpx.get(f"{qwen_server.url}/v1/images/files/nope", headers=auth()).status_code == 404


BAD_REQUESTS = [
    (b"{not json", "invalid_json"),
    (json.dumps({}).encode(), "missing_required_parameter"),
    (json.dumps({"prompt": 3}).encode(), "invalid_type"),
    (json.dumps({"prompt": "x" * 4001}).encode(), "string_above_max_length"),
    (json.dumps({"prompt": "a", "size": "63x64"}).encode(), "invalid_value"),
    (json.dumps({"prompt": "a", "size": "big"}).encode(), "invalid_value"),
    (json.dumps({"prompt": "a", "n": 0}).encode(), "invalid_value"),
    (json.dumps({"prompt": "a", "n": 100}).encode(), "invalid_value"),
    (json.dumps({"prompt": "a", "num_inference_steps": 201}).encode(), "invalid_value"),
    (json.dumps({"prompt": "a", "num_inference_steps": 0}).encode(), "invalid_value"),
    (json.dumps({"prompt": "a", "response_format": "gif"}).encode(), "invalid_value"),
    (json.dumps({"prompt": "a", "seed": "abc"}).encode(), "invalid_type"),
    (json.dumps({"prompt": "a", "model": "dall-e-3"}).encode(), "model_not_found"),
    (json.dumps({"prompt": "a", "stream": True, "partial_images": 4}).encode(), "invalid_value"),
    (json.dumps({"prompt": "a", "stream": "yes"}).encode(), "invalid_type"),
]


def test_bad_requests_never_reach_the_stage(qwen_server):
    def completed() -> float:
        for line in httpx.get(f"{qwen_server.url}/metrics").text.splitlines():
            if line.startswith("omni_stage_requests_completed_total"):
                return float(line.split()[-1])
        raise AssertionError("metric missing")

    before = completed()
    for body, code in BAD_REQUESTS:
        r = httpx.post(
            f"{qwen_server.url}/v1/images/generations",
            content=body,
            headers={**auth(), "content-type": "application/json"},
        )
        assert 400 <= r.status_code < 500, (body, r.status_code)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, (body, err)
    assert completed() == before
    r = httpx.post(f"{qwen_server.url}/v1/images/generations", json={"prompt": "a"})
    assert r.status_code == 401  # no key
    r = httpx.post(f"{qwen_server.url}/v1/chat/completions", headers=auth(), json={})
    assert r.status_code == 400 and "no stage that produces text" in r.json()["error"]["message"]


def test_stream_partial_images_then_the_same_image(qwen_server):
    """The official client's streaming call: 2 previews in order (after steps 1 and 2 of 3),
    then the image, which equals the non-streamed image of the same seed. A raw read shows the
    progress comments. Few steps: a preview is a VAE decode, several denoising steps of the
    tiny model on a CPU, and the server's request_timeout_s is short."""
    stream = client(qwen_server).images.generate(
        model=qwen_server.model,
        prompt=PROMPT,
        size="64x64",
        stream=True,
        partial_images=2,
        extra_body={"seed": 21, "num_inference_steps": 3},
    )
    events = list(stream)
    assert [e.type for e in events] == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(e.size == "64x64" and e.output_format == "png" for e in events)
    plain = generate(qwen_server, seed=21, num_inference_steps=3)[0]
    assert (decode(events[-1].b64_json) == plain).all()
    assert decode(events[0].b64_json).shape == (64, 64, 3)
    assert not (decode(events[0].b64_json) == plain).all()  # a preview, not the image
    # No previews asked: progress only, one comment per step, then the same image.
    body = {"prompt": PROMPT, "size": "64x64", "seed": 21, "num_inference_steps": 3}
    with httpx.stream(
        "POST",
        f"{qwen_server.url}/v1/images/generations",
        headers=auth(),
        json={**body, "stream": True},
        timeout=60,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    steps = [
        json.loads(line.split(" ", 2)[2])["step"]
        for line in text.splitlines()
        if line.startswith(": omni.progress ")
    ]
    assert steps == [1, 2, 3], text[:500]
    assert "partial_image" not in text and text.count("event: image_generation.completed") == 1


# ---- Bounds: admission, bodies, owners, nested JSON --------------------------------------
def _metric(server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_burst_past_the_bound_gets_429s_and_every_other_request_its_image(qwen_server):
    """qwen_server holds QWEN_MAX_BATCH running + QWEN_MAX_QUEUED waiting requests; a burst of
    10 gets exactly the excess answered 429 (OpenAI's shape, Retry-After) and an image for every
    other request, and nothing stays held afterwards.

    The stage process is paused (SIGSTOP) while the burst arrives, so no admitted request can
    finish and free its place before the last one is counted, however slowly a loaded machine
    sends the burst; admission is the API server's, which keeps answering."""
    held = QWEN_MAX_BATCH + QWEN_MAX_QUEUED
    burst = 10
    stage = next(p for p in qwen_server.descendants() if "omni-stage-0" in " ".join(p.cmdline()))

    def one(seed: int) -> httpx.Response:
        return httpx.post(
            f"{qwen_server.url}/v1/images/generations",
            headers=auth(),
            json={"prompt": PROMPT, "size": "64x64", "seed": seed, "num_inference_steps": 4},
            timeout=120,
        )

    stage.suspend()
    try:
        with ThreadPoolExecutor(burst) as pool:
            pending = [pool.submit(one, seed) for seed in range(100, 100 + burst)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in pending) < burst - held:  # the refusals come at once
                assert time.monotonic() < deadline, [f.done() for f in pending]
                time.sleep(0.05)
            assert not any(f.done() and f.result().status_code == 200 for f in pending)
            stage.resume()
            answers = [f.result() for f in pending]
    finally:
        stage.resume()
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200] * held + [429] * (burst - held), statuses
    for r in answers:
        if r.status_code == 429:
            err = r.json()["error"]
            assert err["code"] == "too_many_requests" and "max_queued_requests" in err["message"]
            assert set(err) == {"message", "type", "param", "code"}
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert decode(r.json()["data"][0]["b64_json"]).shape == (64, 64, 3)
    assert _metric(qwen_server, "omni_image_requests_running") == 0
    assert _metric(qwen_server, "omni_image_requests_waiting") == 0


def test_a_256_mib_chunked_body_gets_413_on_every_route_with_memory_flat(qwen_server):
    """Every route the plugin adds (the videos routes have their own server, test_videos.py)
    stops reading a chunked body at its limit: 413, long before 256 MiB were sent, and the API
    server's memory does not grow by the body."""
    from test_fuzz import our_routes

    server_proc = psutil.Process(qwen_server.proc.pid)
    rss0 = server_proc.memory_info().rss
    routes = [(m, p.replace("{token}", "x")) for m, p in our_routes() if "/videos" not in p]
    assert ("POST", "/v1/images/edits") in routes and ("POST", "/v1/images/generations") in routes
    for method, path in routes:
        edits = path.endswith("edits")
        kind = "multipart/form-data; boundary=b" if edits else "application/json"
        status, body, sent = send_chunked(
            qwen_server.url,
            method,
            path,
            {**auth(), "Content-Type": kind},
            prefix=MULTIPART_FILE_START if edits else b"",
        )
        assert status == 413, (method, path, status, body)
        assert body["error"]["code"] == "body_too_large", (method, path, body)
        assert sent < 128 << 20, (method, path, sent)  # the server stopped reading early
    growth = server_proc.memory_info().rss - rss0
    assert growth < 32 << 20, growth


def test_a_url_image_is_only_for_the_key_that_made_it(qwen_server):
    res = client(qwen_server).images.generate(
        model=qwen_server.model,
        prompt=PROMPT,
        size="64x64",
        response_format="url",
        extra_body={"seed": 4, "num_inference_steps": 2},
    )
    url = res.data[0].url
    assert httpx.get(url, headers=auth()).status_code == 200
    other = httpx.get(url, headers={"Authorization": f"Bearer {OTHER_KEY}"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"


def test_deeply_nested_json_is_a_400(qwen_server):
    for body in (
        '{"prompt": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"prompt": "a", "x": ' + '{"a":' * 40 + "1" + "}" * 40 + "}",
    ):
        r = httpx.post(
            f"{qwen_server.url}/v1/images/generations",
            headers={**auth(), "Content-Type": "application/json"},
            content=body,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def _in_flight(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("omni_stage_requests_in_flight"):
            return float(line.split()[-1])
    raise AssertionError("metric missing")


# ~12 s here (the engine does 200 tiny steps at 256x256 in ~1 s): still running at the kill.
LONG = {"prompt": PROMPT, "size": "1024x1024", "num_inference_steps": 200, "seed": 2}


def test_client_disconnect_cancels_the_work(qwen_server):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{qwen_server.url}/v1/images/generations", headers=auth(), json=LONG, timeout=1.5
        )
    deadline = time.monotonic() + 5
    while _in_flight(qwen_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(qwen_server) == 0
    # The stage is free again: a small request is not stuck behind 200 steps at 256x256.
    t0 = time.monotonic()
    generate(qwen_server, seed=1)
    assert time.monotonic() - t0 < 10


def test_stream_disconnect_aborts_the_work(qwen_server):
    with httpx.stream(
        "POST",
        f"{qwen_server.url}/v1/images/generations",
        headers=auth(),
        json={**LONG, "stream": True},
        timeout=30,
    ) as r:
        for line in r.iter_lines():
            if line.startswith(": omni.progress"):
                break  # denoising has started: hang up mid-stream
    deadline = time.monotonic() + 5
    while _in_flight(qwen_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(qwen_server) == 0
    # The stage dropped it too: a small request is not stuck behind ~12 s of steps.
    t0 = time.monotonic()
    generate(qwen_server, seed=1)
    assert time.monotonic() - t0 < 10


def test_request_timeout_is_a_504_and_aborts_the_work(qwen_server):
    # 1024x1024 images of 200 steps, as many as one request may ask here (n is bounded by the
    # stage's max_batch_size): well past the server's limit, REQUEST_TIMEOUT_S.
    huge = {**LONG, "n": QWEN_MAX_BATCH}
    t0 = time.monotonic()
    r = httpx.post(
        f"{qwen_server.url}/v1/images/generations", headers=auth(), json=huge, timeout=120
    )
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "request_timeout" and "request_timeout_s" in err["message"]
    assert REQUEST_TIMEOUT_S <= took < REQUEST_TIMEOUT_S + 10
    assert _in_flight(qwen_server) == 0
    # The stage dropped the request: a small one is not stuck behind it.
    t0 = time.monotonic()
    generate(qwen_server, seed=1)
    assert time.monotonic() - t0 < 10
    assert "unfinished after" in qwen_server.log.read_text()


def test_killed_stage_fails_fast_then_recovers(qwen_server):
    stage = next(p for p in qwen_server.descendants() if "omni-stage-0" in " ".join(p.cmdline()))
    result: dict = {}

    def long_request():
        r = httpx.post(
            f"{qwen_server.url}/v1/images/generations", headers=auth(), json=LONG, timeout=60
        )
        result["response"], result["t"] = r, time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    # Killed once the request is at the stage (in flight there), however long that takes.
    deadline = time.monotonic() + 60
    while _in_flight(qwen_server) < 1:
        assert time.monotonic() < deadline, "the long request never reached the stage"
        time.sleep(0.05)
    killed_at = time.monotonic()
    stage.kill()
    thread.join(30)
    r = result["response"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "stage_unavailable"
    assert result["t"] - killed_at < 5
    deadline = time.monotonic() + 180
    while httpx.get(f"{qwen_server.url}/health").status_code != 200:
        assert time.monotonic() < deadline, qwen_server.log_tail()
        time.sleep(0.5)
    assert len(generate(qwen_server, seed=1)) == 1
    assert "stage 0 (diffusion) died with exit code -9" in qwen_server.log.read_text()
    assert "omni_stage_restarts_total" in httpx.get(f"{qwen_server.url}/metrics").text


def test_sigterm_leaves_no_orphans(qwen_server):
    procs = qwen_server.descendants()
    titles = [" ".join(p.cmdline()) for p in procs]
    assert any("omni-stage-0" in t for t in titles), titles
    qwen_server.stop()
    assert qwen_server.proc.returncode is not None
    # The stages end with the server, each at its own pace on a busy machine: wait for that
    # (an orphan never ends, so it still fails after the bound).
    deadline = time.monotonic() + ORPHAN_BOUND_S
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and f"--port {qwen_server.port}" in " ".join(p.info["cmdline"])
    ]
