"""Two DiT replicas of the tiny Qwen-Image on a real two-node Ray cluster (CPU), behind one
`vllm serve` (stage_configs/qwen_image_tiny_ray.yaml), driven by the official openai client.

* 16 concurrent requests all succeed and both replicas, one per node, served some.
* SIGKILL of one replica's actor process while it holds requests (its stage process paused,
  so they are still in flight): every request still gets
  its image, and the same image the same seed gave before the kill (the lost ones are retried
  on the other replica: a fixed-seed diffusion request is safe to retry); requests sent while
  it is down are served by the other replica; Ray restarts it (a new process on the same node)
  and it serves again.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from free_ports import free_port
from ray_cluster import TwoNodeRay, replica_actor_pid, replica_rows

pytestmark = pytest.mark.slow

# A seed's image is the same whichever replica draws it, up to float rounding: requests batched
# differently (4 on one replica vs 2) take other matmul shapes, so PNGs need not be bit-equal.
# A different seed or a lost seed changes most pixels by tens of levels.
PIXEL_TOLERANCE = 2  # of 255, per channel
STEPS = "40"  # long enough for a batch of 16 to be in flight for a few seconds on this CPU
SEED0 = "1000"


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    model = tiny_models("qwen-image")
    ray = TwoNodeRay(tmp_path_factory.mktemp("ray"))
    port = free_port()
    try:
        t0 = time.monotonic()
        ray.start()
        t1 = time.monotonic()
        ray.serve(model, "qwen_image_tiny_ray", port)
        url = f"http://127.0.0.1:{port}"
        ray.wait_healthy(url, timeout=300)
        print(
            f"two Ray nodes up in {t1 - t0:.1f} s, server healthy {time.monotonic() - t1:.1f} s later"
        )
        yield ray, url, str(model)
    finally:
        ray.stop()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_same_images(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        worst = max(abs(a - b) for a, b in zip(g["pixels"], w["pixels"], strict=True))
        assert worst <= PIXEL_TOLERANCE, (g["i"], worst)


def _metrics(ray: TwoNodeRay, url: str) -> str:
    return ray.call("get", f"{url}/metrics")["text"]


def _generate(ray: TwoNodeRay, url: str, model: str, n: int = 16) -> list[dict]:
    return ray.call("generate", url, model, str(n), SEED0, STEPS)


@pytest.fixture(scope="module")
def reference(cluster):
    """The first 16 concurrent requests: their images by seed, for the fault test."""
    ray, url, model = cluster
    return _generate(ray, url, model)


def test_sixteen_concurrent_requests_use_both_replicas_on_both_nodes(cluster, reference):
    ray, url, _ = cluster
    assert [r["status"] for r in reference] == [200] * 16, reference
    done = replica_rows(_metrics(ray, url), "omni_replica_requests_completed_total")
    assert sorted(node for node, _ in done.values()) == sorted([ray.head_ip, ray.node_ip])
    assert all(count > 0 for _, count in done.values()), done
    assert sum(count for _, count in done.values()) == 16


def test_killing_a_replica_loses_no_request(cluster, reference):
    ray, url, model = cluster
    before = replica_rows(_metrics(ray, url), "omni_replica_requests_completed_total")
    victim = next(i for i, (node, _) in before.items() if node == ray.node_ip)
    pid = replica_actor_pid(ray.node_ns)
    stage_pids = [
        p.pid
        for p in psutil.Process(pid).children(recursive=True)
        if "omni-stage-0" in " ".join(p.cmdline())
    ]
    assert len(stage_pids) == 1, stage_pids

    # The victim's stage process is paused before the load arrives, so the requests routed to
    # it cannot finish before the kill, however slowly this machine schedules the test (the
    # stall timeout is minutes; a pause of seconds is far below it).
    os.kill(stage_pids[0], signal.SIGSTOP)
    try:
        watcher = ray.call_async("wait_busy", url, ray.node_ip, "60")
        load = ray.call_async("generate", url, model, "16", SEED0, STEPS)
        busy = json.loads(watcher.communicate(timeout=90)[0].strip().splitlines()[-1])
        assert busy["busy"], "the replica on the second node never held a request"
        log_at_kill = ray.server_log_size()
        os.kill(pid, signal.SIGKILL)  # the replica's process, its requests still in flight
    finally:
        os.kill(stage_pids[0], signal.SIGCONT)  # it reads EOF on its control socket and exits
    out, err = load.communicate(timeout=300)
    results = json.loads(out.strip().splitlines()[-1])

    # Nothing lost: the requests in flight on the dead replica were retried on the other one,
    # and every image is the one its seed gave before (same steps, same seed).
    assert [r["status"] for r in results] == [200] * 16, results
    assert_same_images(results, reference)
    after_kill = ray.server_log_since(log_at_kill)
    assert "on another replica" in after_kill, "no request was in flight on the killed replica"

    # Serving continues while it is down, and Ray brings it back on the same node.
    t0 = time.monotonic()
    while_down = _generate(ray, url, model, n=4)
    assert [r["status"] for r in while_down] == [200] * 4, while_down
    while True:
        metrics = _metrics(ray, url)
        up = replica_rows(metrics, "omni_replica_up")
        restarts = replica_rows(metrics, "omni_replica_restarts_total")
        if up[victim][1] == 1.0 and restarts[victim][1] >= 1:
            break
        assert time.monotonic() - t0 < 240, ray.server_tail()
        time.sleep(0.5)
    assert up[victim][0] == ray.node_ip
    new_pid = replica_actor_pid(ray.node_ns)
    assert new_pid != pid
    # The killed actor's stage process read EOF on its control socket and exited: no orphan.
    assert not _alive(stage_pids[0]), "the dead replica's stage process outlived it"

    # Throughput returns: the restarted replica serves its share again.
    mid = replica_rows(_metrics(ray, url), "omni_replica_requests_completed_total")
    again = _generate(ray, url, model)
    assert [r["status"] for r in again] == [200] * 16, again
    assert_same_images(again, reference)
    after = replica_rows(_metrics(ray, url), "omni_replica_requests_completed_total")
    assert after[victim][1] > mid[victim][1], (mid, after)
