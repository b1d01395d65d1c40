"""Qwen3-Omni speech with two replicas of every stage on a real two-node Ray cluster (CPU, the
tiny checkpoint, stage_configs/qwen3_omni_ray_tiny.yaml), streamed through the official openai
client (tests/multinode/ns_client.py, run in the head's namespace).

* A streamed pcm16 answer (greedy talker; more audio chunks than Code2Wav's window, so the
  caller's Credits go back through Ray) equals the local pipeline's (qwen3_omni_tiny.yaml,
  every stage one process on one host) on either chain of replicas: the same transcript, the
  same number of samples and audio deltas, every sample within float rounding
  (PCM_TOLERANCE); a text-only answer (the thinker's replicas alone) equals it exactly. The
  local answers: tests/speech_reference.py.
* A client that hangs up mid-stream frees every replica of its chain.
* A talker replica killed while 16 concurrent streams run (its stage process paused first, so
  the requests routed to it are surely in flight) fails exactly its own requests with 503; the
  others stream to the end with the expected audio. Ray restarts it on the same node and it
  serves again.

Over 60 s: the tiny Qwen3-Omni started as six replicas on Ray on a 2-core CPU box (four of them
loading a vLLM engine), a replica's restart, and the local reference's start-up unless
tests/multinode/test_qwen3_omni_nodes.py's run already served it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from free_ports import free_port
from ns_http import NsHttp
from ray_cluster import REPO, TwoNodeRay, replica_actor_pid, replica_rows
from speech_reference import CODE2WAV_WINDOW, THINKER_TOKENS
from speech_reference import TALKER as TALKER_SETTINGS

pytestmark = pytest.mark.slow

NS_CLIENT = REPO / "tests" / "multinode" / "ns_client.py"
RAY_TINY = "qwen3_omni_ray_tiny"
# The talker as the local reference ran it (speech_reference.TALKER: greedy, exactly FRAMES
# codec frames, so more audio chunks than Code2Wav's window): every layout gives the same
# audio, and the Credits for the caller's chunks must come back through Ray.
OVERRIDES = ["--stage-overrides", json.dumps({"1": TALKER_SETTINGS})]
TALKER = 1
CONCURRENT = 16
# A Ray actor's torch runs the threads its CPUs allow (1 here), the local stages as many as
# the machine's: reductions add in another order, so Code2Wav's samples may differ in their
# last bits (by 1 at most, seen here). Other codec frames (a greedy choice gone another
# way) change the waveform by thousands.
PCM_TOLERANCE = 16  # of 32767


def assert_same_speech(got: dict, want: dict) -> None:
    import array
    import base64

    same = ("transcript", "samples", "audio_deltas", "error")
    assert {k: got[k] for k in same} == {k: want[k] for k in same}, {k: got[k] for k in same}
    a, b = array.array("h"), array.array("h")
    a.frombytes(base64.b64decode(got["pcm"]))
    b.frombytes(base64.b64decode(want["pcm"]))
    peak = max(abs(x) for x in b)
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    print(f"speech: worst sample difference {worst} of a peak of {peak}")
    assert peak > 100 * PCM_TOLERANCE and worst <= PCM_TOLERANCE, (worst, peak)


def speech_async(cluster: TwoNodeRay, url: str, model: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", cluster.head_ns, sys.executable, str(NS_CLIENT), "speech"]
        + [url, model, THINKER_TOKENS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def answer_of(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def speech(cluster: TwoNodeRay, url: str, model: str) -> dict:
    return answer_of(speech_async(cluster, url, model))


def chat(cluster: TwoNodeRay, url: str, model: str) -> dict:
    """A text-only answer: the thinker alone (vLLM's chat route on the chat stage)."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", cluster.head_ns, sys.executable, str(NS_CLIENT), "chat"]
        + [url, model, THINKER_TOKENS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    return answer_of(proc)


def metrics(web: NsHttp, url: str) -> str:
    return web.get(f"{url}/metrics")["text"]


def wait_healthy(cluster: TwoNodeRay, web: NsHttp, url: str) -> None:
    t0 = time.monotonic()
    while web.get(f"{url}/health")["status"] != 200:
        assert cluster.server.poll() is None, cluster.server_tail()
        assert time.monotonic() - t0 < 600, cluster.server_tail()
        time.sleep(0.5)


@pytest.fixture(scope="module")
def omni(tiny_models, tmp_path_factory, qwen3_omni_local_answers):
    """The same checkpoint as the local pipeline's answers (speech, text) served on Ray:
    (cluster, url, model, speech reference, text reference, GETs in the head's namespace)."""
    reference = qwen3_omni_local_answers["speech"]
    text_reference = qwen3_omni_local_answers["chat"]
    assert reference["error"] is None, reference
    assert reference["audio_deltas"] > CODE2WAV_WINDOW, reference["audio_deltas"]
    assert text_reference["error"] is None and text_reference["text"], text_reference
    model = str(tiny_models("qwen3-omni"))
    cluster = TwoNodeRay(tmp_path_factory.mktemp("ray-omni"), cpus_per_node=3)
    url = f"http://127.0.0.1:{free_port()}"
    port = url.rsplit(":", 1)[1]
    web = None
    try:
        cluster.start()
        web = NsHttp(cluster.head_ns)
        t0 = time.monotonic()
        cluster.serve(model, RAY_TINY, int(port), *OVERRIDES)
        wait_healthy(cluster, web, url)
        print(f"six replicas on Ray healthy in {time.monotonic() - t0:.1f} s")
        yield cluster, url, model, reference, text_reference, web
    finally:
        if web is not None:
            web.close()
        cluster.stop()


def test_streamed_speech_on_either_chain_equals_the_local_pipeline(omni):
    cluster, url, model, reference, text_reference, web = omni
    # One request at a time: idle replicas take turns, so the two answers ran on both chains.
    for _ in range(2):
        assert_same_speech(speech(cluster, url, model), reference)
    text = metrics(web, url)
    for stage in (0, 1, 2):
        done = replica_rows(text, "omni_replica_requests_completed_total", stage)
        assert sorted(n for n, _ in done.values()) == sorted([cluster.head_ip, cluster.node_ip])
        assert [count for _, count in sorted(done.values())] == [1.0, 1.0], (stage, done)
    # A text-only answer runs on a thinker replica alone, as the local thinker writes it.
    assert [chat(cluster, url, model) for _ in range(2)] == [text_reference] * 2


def completed(text: str) -> float:
    """Requests the talker's replicas completed, together."""
    rows = replica_rows(text, "omni_replica_requests_completed_total", TALKER)
    return sum(v for _, v in rows.values())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_flight(text: str) -> float:
    """Requests in flight on every replica of every stage, together."""
    rows = [replica_rows(text, "omni_replica_requests_in_flight", sid) for sid in (0, 1, 2)]
    return sum(v for r in rows for _, v in r.values())


def stage_processes(cluster: TwoNodeRay, stage: int) -> list[int]:
    """The stage processes of `stage`'s two replicas (one on each node)."""
    title = f"omni-stage-{stage}"
    return [
        c.pid
        for ns in (cluster.head_ns, cluster.node_ns)
        for c in psutil.Process(replica_actor_pid(ns, stage)).children(recursive=True)
        if title in " ".join(c.cmdline())
    ]


def test_a_client_gone_mid_stream_frees_every_replica(omni, tmp_path):
    """A client that hangs up after its first audio chunk: the request is cancelled in every
    replica of its chain, nothing stays in flight and it completes nowhere. Code2Wav's replicas
    are paused from the first chunk to the hang-up, so the answer cannot have finished by
    then, however fast the rest would come."""
    cluster, url, model, *_, web = omni
    mark = tmp_path / "first-audio"
    code2wav = stage_processes(cluster, 2)
    client = subprocess.Popen(
        ["ip", "netns", "exec", cluster.head_ns, sys.executable, str(NS_CLIENT), "speech"]
        + [url, model, THINKER_TOKENS, str(mark)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        t0 = time.monotonic()
        while not mark.exists():
            assert client.poll() is None, client.communicate()
            assert time.monotonic() - t0 < 120, "no audio"
            time.sleep(0.05)
        for pid in code2wav:
            os.kill(pid, signal.SIGSTOP)
        text = metrics(web, url)
        done = replica_rows(text, "omni_replica_requests_completed_total", 2)
        assert sum(v for _, v in replica_rows(text, "omni_replica_requests_in_flight", 2).values())
        client.kill()  # `ip netns exec` ran python in its place: the client's socket closes
        client.communicate()
        t0 = time.monotonic()
        while in_flight(text := metrics(web, url)) > 0:
            assert time.monotonic() - t0 < 30, cluster.server_tail()
            time.sleep(0.2)
    finally:
        for pid in code2wav:
            os.kill(pid, signal.SIGCONT)  # each then reads its Abort
        if client.poll() is None:
            client.kill()
    assert replica_rows(text, "omni_replica_requests_completed_total", 2) == done


def test_a_killed_talker_replica_fails_only_its_own_streams(omni):
    cluster, url, model, reference, _, web = omni
    before = metrics(web, url)
    victim = next(
        i
        for i, (node, _) in replica_rows(before, "omni_replica_up", TALKER).items()
        if node == cluster.node_ip
    )
    actor = replica_actor_pid(cluster.node_ns, TALKER)
    (stage_proc,) = [
        p.pid
        for p in psutil.Process(actor).children(recursive=True)
        if "omni-stage-1" in " ".join(p.cmdline())
    ]

    done_before = completed(before)

    # Paused before the load: the streams routed to the victim stay in flight until the kill.
    os.kill(stage_proc, signal.SIGSTOP)
    try:
        clients = [speech_async(cluster, url, model) for _ in range(CONCURRENT)]
        t0 = time.monotonic()
        while True:
            text = metrics(web, url)
            talkers = replica_rows(text, "omni_replica_requests_in_flight", TALKER)
            held = talkers[victim][1]
            # Every stream reached a talker replica (some may be done), the victim holds some.
            reached = sum(v for _, v in talkers.values()) + completed(text) - done_before
            if held >= 1 and reached == CONCURRENT:
                break
            assert all(c.poll() is None for c in clients), "a stream ended before the kill"
            assert time.monotonic() - t0 < 120, cluster.server_tail()
            time.sleep(0.1)
        log_at_kill = cluster.server_log_size()
        os.kill(actor, signal.SIGKILL)  # the replica's actor, its streams still in flight
    finally:
        os.kill(stage_proc, signal.SIGCONT)  # it reads EOF on its control socket and exits
    answers = [answer_of(c) for c in clients]

    failed = [a for a in answers if a["error"] is not None]
    served = [a for a in answers if a["error"] is None]
    print(f"{len(failed)} of {CONCURRENT} streams were on the killed replica")
    assert len(failed) == held, (held, [a["error"] for a in answers])
    for a in failed:
        assert a["error"]["body"]["type"] == "service_unavailable_error", a
    assert served, "every stream was on the killed replica"
    for a in served:
        assert a["samples"] == reference["samples"], a["samples"]
        assert a["audio_deltas"] == reference["audio_deltas"], a["audio_deltas"]
    assert "on another replica" not in cluster.server_log_since(log_at_kill)  # never retried

    # Ray restarts it on the same node; it serves again (idle replicas take turns).
    t0 = time.monotonic()
    while True:
        text = metrics(web, url)
        up = replica_rows(text, "omni_replica_up", TALKER)
        restarts = replica_rows(text, "omni_replica_restarts_total", TALKER)
        if up[victim][1] == 1.0 and restarts[victim][1] >= 1:
            break
        assert time.monotonic() - t0 < 300, cluster.server_tail()
        time.sleep(0.5)
    assert up[victim][0] == cluster.node_ip
    assert replica_actor_pid(cluster.node_ns, TALKER) != actor
    assert not _alive(stage_proc), "the dead replica's stage process outlived it"
    mid = replica_rows(metrics(web, url), "omni_replica_requests_completed_total", TALKER)
    for _ in range(2):
        assert_same_speech(speech(cluster, url, model), reference)
    after = replica_rows(metrics(web, url), "omni_replica_requests_completed_total", TALKER)
    assert after[victim][1] == mid[victim][1] + 1, (mid, after)
