"""Stuck-stage watchdog, end to end: `vllm serve TINY_QWEN --stage-config` (one diffusion stage)
with `stall_timeout_s: 3` for the stage.

* An idle stage is never flagged, and a request that runs longer than the deadline while it
  makes progress (its steps pulse) finishes normally.
* SIGSTOP of the stage process mid-request (alive, holding the request, silent): the request
  is answered 503 with OpenAI's error object within the deadline (+ the supervisor's 0.5 s
  round and slack for a loaded 2-core box), /health is unhealthy, the stopped process and its
  children are SIGKILLed, the stage restarts, /health is healthy again and a new request
  succeeds.
* SIGTERM of the server then leaves no process behind.

The tests run in file order and share one server.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest
from omni_server import API_KEY, REPO, Server, alive

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 3.0
# The supervisor checks every 0.5 s; the rest is scheduling slack on a loaded 2-core box.
ANSWER_WITHIN_S = STALL_TIMEOUT_S + 2.0
# A tiny Qwen-Image step at 128x128 takes milliseconds, so a long request needs many steps,
# and how long it runs depends on the machine's load: the first test grows the step count until
# one request runs for twice the deadline, and the SIGSTOP test reuses it (so it is surely
# mid-request). Steps, not sizes: a large image's VAE decode is one silent stretch that can
# outlast a 3 s deadline by itself (a real limit of the watchdog: the deadline must exceed
# the longest stretch without a step, which the 300 s default does).
SIZE = "128x128"
LONG_STEPS = (200, 800, 3200)
MAX_STEPS = LONG_STEPS[-1]
long_request: dict[str, int] = {}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    model = tiny_models("qwen-image")
    root = tmp_path_factory.mktemp("watchdog-server")
    config = root / "qwen_image_tiny_stall.yaml"
    config.write_text(
        f"base_config: {REPO / 'stage_configs' / 'qwen_image_tiny.yaml'}\n"
        f"stages:\n  - stage_id: 0\n    stall_timeout_s: {STALL_TIMEOUT_S}\n"
        f"    max_num_inference_steps: {MAX_STEPS}\n"
    )
    srv = Server([str(model), "--stage-config", str(config), "--api-key", API_KEY], root / "log")
    try:
        srv.wait_healthy(timeout=300)
        yield srv
    finally:
        srv.stop()


def post(server, steps: int = 2, size: str = "64x64") -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/images/generations",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": "a red kite", "size": size, "num_inference_steps": steps, "seed": 3},
        timeout=120,
    )


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(rf"^{name}\{{[^}}]*stage_id=\"0\"[^}}]*\}} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def stage_process(server) -> psutil.Process:
    return next(
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if "omni-stage-0" in " ".join(p.cmdline())
    )


def healthy(server) -> bool:
    return httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def wait_for(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.05)
    return time.monotonic() - t0


def test_idle_and_progressing_stages_are_not_flagged(server):
    time.sleep(STALL_TIMEOUT_S + 1.0)  # idle for longer than the deadline
    for steps in LONG_STEPS:
        t0 = time.monotonic()
        r = post(server, steps=steps, size=SIZE)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        if took > 2 * STALL_TIMEOUT_S:
            break
    # The request must outlast the deadline, or it proves nothing about pulses.
    assert took > STALL_TIMEOUT_S, f"request took only {took:.1f} s at {steps} steps"
    long_request["steps"] = steps
    assert metric(server, "omni_stage_stalls_total") == 0.0
    assert healthy(server)


def test_sigstopped_stage_fails_its_request_503_and_restarts(server):
    stage = stage_process(server)
    family = [stage, *stage.children(recursive=True)]
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: result.update(
            r=post(server, steps=long_request.get("steps", MAX_STEPS), size=SIZE)
        )
    )
    thread.start()
    wait_for(
        lambda: metric(server, "omni_stage_requests_in_flight") == 1.0, 30, "request not in flight"
    )
    time.sleep(0.3)  # a few denoising steps in
    os.kill(stage.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    thread.join(60)
    answered = time.monotonic() - stopped
    r = result["r"]
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "stage_unavailable" and "made no progress" in error["message"], error
    assert answered <= ANSWER_WITHIN_S, f"503 after {answered:.1f} s (deadline {STALL_TIMEOUT_S})"
    assert not healthy(server)
    # SIGKILLed, not left stopped: the stage and everything it started are gone.
    wait_for(lambda: not any(alive(p) for p in family), 15, "stopped stage still there")
    wait_for(lambda: healthy(server), 180, "stage did not come back")
    assert stage_process(server).pid != stage.pid
    assert post(server).status_code == 200
    assert metric(server, "omni_stage_stalls_total") == 1.0
    assert metric(server, "omni_stage_restarts_total") == 1.0
    print(f"stall: 503 after {answered:.2f} s (stall_timeout_s {STALL_TIMEOUT_S})")


def test_sigterm_leaves_no_process_behind(server):
    family = [psutil.Process(server.proc.pid), *server.descendants()]
    assert len(family) >= 2
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(60)
    wait_for(lambda: not any(alive(p) for p in family), 30, "orphans after SIGTERM")
