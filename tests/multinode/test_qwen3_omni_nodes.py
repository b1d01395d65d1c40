"""Qwen3-Omni speech across two simulated hosts (network namespaces and a veth pair).

The thinker and the API server on the head, the talker and Code2Wav on a headless node
(stage_configs/qwen3_omni_nodes_tiny.yaml, the tiny checkpoint): the thinker's text ids cross
the veth over the edge's TCP channel, the codec frames go from talker to Code2Wav on the
node, the audio chunks come back over the node link. The client runs in the head's
namespace (ns_client.py).

Checked: the streamed pcm16 answer (greedy) equals, byte for byte, the local pipeline's
(qwen3_omni_tiny.yaml, every stage on one host: tests/speech_reference.py), for a text prompt
and for one with an image, whose media states (the thinker's first chunk to the talker) cross
through NIXL (UCX over TCP on the veth; the thinker's stream_nixl_min_bytes lowered to fit the
tiny model's states) while its token ids go inline, as the head's /metrics counts; a node
killed mid-stream fails its request with 503 (an error event of type
service_unavailable_error, counted as 503 in /metrics) within the heartbeat bound, and speech
works again once the node is back.

Over 60 s: two start-ups of head and node of the tiny Qwen3-Omni on a 2-core CPU box, then the
node's again, each loading a vLLM engine or two (and the local reference's, unless
tests/ray/test_ray_speech.py's run already served it).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time

import cluster
import pytest
from cluster import NS_CLIENT, REPO, Proc, ns_call, ns_wait_healthy
from free_ports import free_port
from ns_http import NsHttp
from speech_reference import TALKER, THINKER_TOKENS

pytestmark = pytest.mark.slow

NODES = "stage_configs/qwen3_omni_nodes_tiny.yaml"
# The talker as the local reference ran it (speech_reference.TALKER): exactly FRAMES codec
# frames, greedily (so that both layouts give the same audio), enough that a slow client holds
# the stream open while the node is killed.
OVERRIDES = [
    "--stage-overrides",
    json.dumps(
        {
            # The tiny thinker's states at a 64x64 image's positions are a few hundred bytes
            # (its token id chunks, tens): between them, as megabytes and bytes are in full size.
            # (Only edges between hosts use NIXL: the local reference's are inline.)
            "0": {"stream_nixl_min_bytes": 256},
            "1": TALKER,
        }
    ),
]
# The head notices a dead node at its link's EOF, at the latest after missed heartbeats (5 s).
FAIL_WITHIN_S = 5.0 + 5.0


@pytest.fixture
def hosts():
    with cluster.two_hosts("q", 202) as h:
        yield h


def metric_lines(web: NsHttp, url: str) -> list[str]:
    return web.get(f"{url}/metrics")["text"].splitlines()


def speech_503s(web: NsHttp, url: str) -> float:
    for line in metric_lines(web, url):
        if line.startswith("omni_speech_requests_total{") and 'status="503"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def stage_in_flight(web: NsHttp, url: str, stage_id: int) -> float:
    """Requests the head has submitted to a stage and not yet had its Result for."""
    for line in metric_lines(web, url):
        if line.startswith("omni_stage_requests_in_flight{") and f'stage_id="{stage_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def edge_counter(web: NsHttp, url: str, family: str, path: str, labels: str = "") -> float:
    """A counter of the thinker -> talker edge's chunks that took `path` on the head's
    /metrics (0 when it has none yet)."""
    for line in metric_lines(web, url):
        if line.startswith(f'{family}{{connector="edge_0_1_{path}"{labels}}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_speech_across_two_hosts_equals_local_and_survives_a_node_death(
    qwen3_omni_local_answers, hosts, tiny_models, tmp_path
):
    (ns_h, dev_h, addr_h), (ns_n, dev_n, _) = hosts["head"], hosts["node"]
    model = str(tiny_models("qwen3-omni"))
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_OMNI_AUTHKEY": secrets.token_hex(16),
        "VLLM_HOST_IP": "127.0.0.1",  # vLLM's own engine sockets stay on each host's loopback
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    http = free_port()
    url = f"http://127.0.0.1:{http}"  # the head's loopback, inside its namespace
    serve = ["--host", "127.0.0.1", "--port", str(http), *OVERRIDES]

    reference = qwen3_omni_local_answers["speech"]
    image_reference = qwen3_omni_local_answers["speech_image"]
    assert reference["error"] is None, reference
    assert reference["audio_deltas"] >= 2 and reference["samples"] > 0
    assert image_reference["error"] is None and image_reference["samples"] > 0, image_reference

    master = free_port()
    head_args = [model, "--stage-config", NODES, "--stage-ids", "0", *serve]
    head_args += ["--omni-master-address", "0.0.0.0", "--omni-master-port", str(master)]
    node_args = [model, "--stage-config", NODES, "--headless", "--stage-ids", "1,2", *OVERRIDES]
    node_args += ["--omni-master-address", addr_h, "--omni-master-port", str(master)]
    # NIXL's UCX over TCP on each side's end of the veth, as between hosts without RDMA.
    head_env = {**env, "UCX_TLS": "tcp", "UCX_NET_DEVICES": dev_h}
    node_env = {**env, "UCX_TLS": "tcp", "UCX_NET_DEVICES": dev_n}
    head = Proc(head_args, tmp_path / "head.log", head_env, ns_h)
    node = Proc(node_args, tmp_path / "node.log", node_env, ns_n)
    web = NsHttp(ns_h)  # the head's /metrics, polled below
    try:
        ns_wait_healthy(ns_h, url, [head, node], timeout=600)
        split = ns_call(ns_h, "speech", url, model, THINKER_TOKENS)
        assert split == reference
        assert edge_counter(web, url, "omni_connector_puts_total", "nixl") == 0
        inline_before = edge_counter(web, url, "omni_connector_puts_total", "inline")
        assert inline_before >= 1  # the text prompt's token ids

        assert ns_call(ns_h, "speech-image", url, model, THINKER_TOKENS) == image_reference
        t0 = time.monotonic()  # the talker's counters come with its Result, over the link
        reads = ("omni_connector_transfers_total", "nixl", ',role="consumer"')
        while edge_counter(web, url, *reads) < 1:
            assert time.monotonic() - t0 < 10, head.log_tail()
            time.sleep(0.2)
        assert edge_counter(web, url, *reads) == 1  # the media states, READ once
        assert edge_counter(web, url, "omni_connector_puts_total", "nixl") == 1
        assert edge_counter(web, url, "omni_connector_puts_total", "inline") > inline_before

        # A node killed while an answer streams: once the client has audio, the node is
        # frozen (SIGSTOP), and killed if the head still waits on it for the request. On a
        # loaded machine the node may have finished the answer before the client read its
        # first audio (the rest then sits in socket buffers): that try proves nothing, so the
        # node resumes and another request is sent.
        for attempt in range(3):
            mark = tmp_path / f"first-audio-{attempt}"
            client = subprocess.Popen(
                ["ip", "netns", "exec", ns_h, sys.executable, str(NS_CLIENT), "speech", url]
                + [model, THINKER_TOKENS, str(mark)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            t0 = time.monotonic()
            while not mark.exists():
                assert client.poll() is None, client.communicate()
                assert time.monotonic() - t0 < 300, "no audio"
                time.sleep(0.05)
            node.pause_all()
            if stage_in_flight(web, url, 2) >= 1:
                break
            node.resume_all()
            out, _ = client.communicate(timeout=300)
            assert json.loads(out.strip().splitlines()[-1])["error"] is None, out
        else:
            pytest.fail("the node finished every answer before its client read the first audio")
        before = speech_503s(web, url)
        killed = time.monotonic()
        node.kill_all()
        while speech_503s(web, url) <= before:
            assert time.monotonic() - killed < FAIL_WITHIN_S, head.log_tail()
            time.sleep(0.2)
        out, err = client.communicate(timeout=300)
        answer = json.loads(out.strip().splitlines()[-1])
        assert answer["error"] is not None, answer
        assert answer["error"]["body"]["type"] == "service_unavailable_error", answer
        assert web.get(f"{url}/health")["status"] == 503

        node = Proc(node_args, tmp_path / "node-2.log", node_env, ns_n)
        ns_wait_healthy(ns_h, url, [head, node], timeout=600)
        assert ns_call(ns_h, "speech", url, model, THINKER_TOKENS) == reference
    finally:
        web.close()
        node.stop()
        head.stop()
