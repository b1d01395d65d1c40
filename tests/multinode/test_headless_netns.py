"""Two hosts simulated with network namespaces and a veth pair: head on one, DiT node on the other.

Each namespace sees only its end of the veth (and its own loopback). The node registers with
the head across the veth; the AR -> DiT payload crosses it over NIXL with UCX over TCP. The
test client reaches the head's API server inside the head's namespace (`ip netns exec`).

Over 60 s: a head and a headless node start on a 2-core box, each in its namespace, with a
stage apiece (the head's AR stage loads a vLLM engine), and NIXL connects across the veth.
"""

from __future__ import annotations

import secrets

import cluster
import pytest
from cluster import (
    Proc,
    connector_metric,
    head_args,
    node_args,
    ns_call,
    ns_wait_healthy,
    sh,
    stage_metric,
)
from free_ports import free_port


@pytest.fixture
def two_hosts():
    with cluster.two_hosts("g", 200) as hosts:
        yield hosts


def rx_bytes(ns: str, dev: str) -> int:
    return int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"))


def test_image_across_two_simulated_hosts(two_hosts, tiny_models, tmp_path):
    (ns_h, dev_h, addr_h), (ns_n, dev_n, _) = two_hosts["head"], two_hosts["node"]
    model = tiny_models("glm-image")
    http_port, master = free_port(), free_port()
    common = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "NIXL_LOG_LEVEL": "WARN",
        "UCX_TLS": "tcp",  # what a cross-node link without RDMA uses
        "VLLM_OMNI_AUTHKEY": secrets.token_hex(16),
        "VLLM_HOST_IP": "127.0.0.1",  # vLLM's own engine sockets stay on each host's loopback
    }
    head = Proc(
        # The registry must listen beyond loopback for the other "host": with the key set.
        head_args(model, http_port, master, master_bind="0.0.0.0"),
        tmp_path / "head.log",
        {**common, "UCX_NET_DEVICES": dev_h},
        netns=ns_h,
    )
    node = Proc(
        node_args(model, addr_h, master),
        tmp_path / "node.log",
        {**common, "UCX_NET_DEVICES": dev_n},
        netns=ns_n,
    )
    url = f"http://127.0.0.1:{http_port}"  # the head's loopback, inside its namespace
    try:
        ns_wait_healthy(ns_h, url, [head, node], timeout=400)
        before = rx_bytes(ns_n, dev_n)
        out = ns_call(ns_h, "generate", url, str(model), "5")
        assert out["format"] == "PNG" and out["png"] == [64, 64]
        assert ns_call(ns_h, "generate", url, str(model), "5")["sha"] == out["sha"]
        assert rx_bytes(ns_n, dev_n) > before  # the node received over the veth

        metrics = ns_call(ns_h, "metrics", url)["text"]
        assert connector_metric(metrics, "omni_connector_transfers_total", "nixl", "consumer") == 2
        assert connector_metric(metrics, "omni_connector_bytes_total", "nixl", "consumer") > 0
        assert connector_metric(metrics, "omni_connector_failures_total", "nixl", "consumer") == 0
        assert stage_metric(metrics, "omni_stage_up", 1) == 1.0
        # The node reached the head only through the veth: its registry peer is the veth address.
        assert "registered stage(s) [1] with head " + addr_h in node.log.read_text()
    finally:
        node.stop()
        head.stop()
