"""Head + headless DiT node as separate real `vllm serve` processes on loopback (UCX over lo).

One head start-up and two node start-ups for the whole module: the head runs the AR stage and
the API server; the node runs the DiT stage and registers with it; the AR -> DiT payload crosses over
NIXL (descriptor on the control path, READ by the DiT process). Then the failure cases: a node
that hangs (SIGSTOP: missed heartbeats), a node killed mid-request, then restarted, and a node
that keeps heartbeating while its DiT stage process is stopped (the stall watchdog, with a short
stall_timeout_s for stage 1 on both sides).
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import signal
import threading
import time

import httpx
import psutil
import pytest
from cluster import (
    Proc,
    connector_metric,
    head_args,
    node_args,
    stage_metric,
    wait_status,
)
from free_ports import free_port
from openai import OpenAI
from PIL import Image

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "VLLM_OMNI_AUTHKEY": secrets.token_hex(16),
}
STALL_TIMEOUT_S = 5.0
# Head and node load the same pipeline; the override keeps their stage 1 configs identical.
OVERRIDES = ["--stage-overrides", json.dumps({"1": {"stall_timeout_s": STALL_TIMEOUT_S}})]


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    """Head and node started together (either order works: the node retries until it can
    register). Before registration the head answers 503; test_node_registry.py covers that."""
    model = tiny_models("glm-image")
    logs = tmp_path_factory.mktemp("multinode-lo")
    port, master = free_port(), free_port()
    head = Proc([*head_args(model, port, master), *OVERRIDES], logs / "head.log", ENV)
    head.url = f"http://127.0.0.1:{port}"
    head.model, head.master, head.logs = model, master, logs
    head.node = start_node(head, "node-1.log")
    try:
        wait_status(f"{head.url}/health", 200, head, timeout=400)
        yield head
    finally:
        head.node.stop()
        head.stop()


def start_node(head: Proc, name: str) -> Proc:
    return Proc(
        [*node_args(head.model, "127.0.0.1", head.master), *OVERRIDES], head.logs / name, ENV
    )


def generate(url: str, model: str, seed: int, **extra) -> bytes:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    resp = client.images.generate(
        model=model,
        prompt="a lighthouse on a cliff",
        size=extra.pop("size", "64x64"),
        response_format="b64_json",
        extra_body={"seed": seed, **extra},
    )
    return base64.b64decode(resp.data[0].b64_json)


def post_image(url: str, timeout: float = 60, **body) -> httpx.Response:
    payload = {"prompt": "a lighthouse", "size": "64x64", "seed": 3, **body}
    return httpx.post(f"{url}/v1/images/generations", json=payload, timeout=timeout)


def assert_503(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["type"] == "service_unavailable_error" and err["message"]


def test_generates_image_through_headless_node_over_nixl(cluster):
    model = str(cluster.model)
    first = generate(cluster.url, model, seed=7)
    image = Image.open(io.BytesIO(first))
    assert image.format == "PNG" and image.size == (64, 64)
    low, high = image.convert("L").getextrema()
    assert high - low > 10  # a painted image, not a flat fill
    # Seeded end to end (AR sampling on the head, denoising on the node): same seed, same bytes.
    assert generate(cluster.url, model, seed=7) == first
    assert generate(cluster.url, model, seed=8) != first

    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert connector_metric(metrics, "omni_connector_transfers_total", "nixl", "consumer") >= 3
    assert connector_metric(metrics, "omni_connector_bytes_total", "nixl", "consumer") > 0
    assert connector_metric(metrics, "omni_connector_failures_total", "nixl", "consumer") == 0
    assert stage_metric(metrics, "omni_stage_up", 1) == 1.0
    # The node runs the DiT in the same worker as local stages, titled omni-stage-1.
    titles = [" ".join(p.cmdline()) for p in cluster.node.descendants()]
    assert any("omni-stage-1" in t for t in titles), titles


def test_hung_node_misses_heartbeats_then_recovers(cluster):
    cluster.node.proc.send_signal(19)  # SIGSTOP: the connection stays open, nothing answers
    try:
        t0 = time.monotonic()
        resp = post_image(cluster.url, timeout=30)  # routed to the node, or refused already
        waited = time.monotonic() - t0
        assert_503(resp)
        assert waited < 8.0  # heartbeat deadline (5 s) instead of hanging
        assert httpx.get(f"{cluster.url}/health", timeout=5).status_code == 503
    finally:
        cluster.node.proc.send_signal(18)  # SIGCONT: the node re-registers by itself
    wait_status(f"{cluster.url}/health", 200, cluster.node, timeout=30)
    assert post_image(cluster.url).status_code == 200


def test_node_killed_mid_request_fails_fast_then_restart_resumes(cluster):
    url, model = cluster.url, str(cluster.model)
    before = httpx.get(f"{url}/metrics", timeout=10).text
    outcome: dict = {}

    def long_request() -> None:
        # 200 steps at 256x256 keep the DiT busy for tens of seconds on this CPU.
        resp = post_image(url, timeout=300, size="256x256", num_inference_steps=200)
        outcome["done"] = time.monotonic()
        outcome["resp"] = resp

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until the request sits in the DiT on the node
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        if stage_metric(metrics, "omni_stage_requests_in_flight", 1) == 1:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the request never reached the DiT node")
    node_tree = [cluster.node.proc.pid, *(p.pid for p in cluster.node.descendants())]
    killed = time.monotonic()
    cluster.node.kill_all()
    worker.join(60)
    assert outcome["done"] - killed < 3.0  # fast, not a hang or a timeout
    assert_503(outcome["resp"])

    # The head stays up: it answers, reports unhealthy, and refuses fast.
    assert cluster.proc.poll() is None
    assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
    assert httpx.get(f"{url}/health", timeout=5).status_code == 503
    assert_503(post_image(url))
    assert not [pid for pid in node_tree if _alive(pid)]  # nothing of the node survives

    cluster.node = start_node(cluster, "node-2.log")
    wait_status(f"{url}/health", 200, cluster.node, timeout=300)
    image = Image.open(io.BytesIO(generate(url, model, seed=11)))
    assert image.size == (64, 64)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    for name in ("omni_stage_deaths_total", "omni_stage_restarts_total"):
        assert stage_metric(metrics, name, 1) == stage_metric(before, name, 1) + 1


def test_stuck_stage_on_a_heartbeating_node_fails_503_and_restarts(cluster):
    # The node process runs on and heartbeats; only its DiT stage process is stopped. The node's
    # watchdog sees no Pulse for stall_timeout_s, answers the head 503 (Unavailable), kills the
    # stage and restarts it, and the head serves again once the node says it is ready.
    url = cluster.url
    stage = next(p for p in cluster.node.descendants() if "omni-stage-1" in " ".join(p.cmdline()))
    outcome: dict = {}

    def long_request() -> None:
        outcome["resp"] = post_image(url, timeout=120, size="256x256", num_inference_steps=200)
        outcome["done"] = time.monotonic()

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        if stage_metric(metrics, "omni_stage_requests_in_flight", 1) == 1:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the request never reached the DiT node")
    time.sleep(0.3)  # a few denoising steps in
    os.kill(stage.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    worker.join(60)
    answered = outcome["done"] - stopped
    assert_503(outcome["resp"])
    assert "made no progress" in outcome["resp"].json()["error"]["message"]
    # the deadline, the node's 0.5 s supervisor round, slack for a loaded 2-core box
    assert answered <= STALL_TIMEOUT_S + 2.0, answered
    # SIGKILLed, not left stopped: the node waits at most 10 s for that exit. Then it starts
    # the stage again, a fork of its fork server, often within a second: between two of the
    # node's heartbeats (1 s), so the head's /health may never show the gap. The node's log
    # says when the new process is ready; the head serves from then on.
    assert _gone_within(stage.pid, 10.0)
    restarted = _wait_for_stage_process(cluster, other_than=stage.pid, timeout=120)
    _wait_for_line(cluster.node, ("ready in", f"(pid {restarted.pid})"), timeout=120)
    wait_status(f"{url}/health", 200, cluster.node, timeout=120)
    assert restarted.is_running()
    assert post_image(url).status_code == 200
    assert cluster.node.proc.poll() is None  # the node itself never went away
    print(f"stuck remote stage: 503 after {answered:.2f} s (stall_timeout_s {STALL_TIMEOUT_S})")


def _wait_for_stage_process(cluster, other_than: int, timeout: float) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in cluster.node.descendants():
            try:
                if p.pid != other_than and "omni-stage-1" in " ".join(p.cmdline()):
                    return p
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)
    pytest.fail(f"the node started no new DiT stage process within {timeout:.0f} s")


def _wait_for_line(proc, parts: tuple[str, ...], timeout: float) -> None:
    """Until a line of `proc`'s log holds every one of `parts`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = proc.log.read_text(errors="replace").splitlines()
        if any(all(part in line for part in parts) for line in lines):
            return
        time.sleep(0.1)
    pytest.fail(f"no line with {parts} in {proc.log} within {timeout:.0f} s")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
