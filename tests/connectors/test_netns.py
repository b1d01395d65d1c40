"""Two hosts simulated with network namespaces and a veth pair: NIXL (UCX over TCP) across them.

Each side runs in its own namespace and sees only its end of the veth; the descriptor travels
through this test process (the control path). The veth byte counters prove the payload crossed
the simulated wire rather than a same-host shortcut.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conn_peer import digest, pattern
from conn_peerctl import PeerProcess

MiB = 1 << 20


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def two_hosts():
    tag = f"{os.getpid() % 100000}"
    hosts = {
        "a": (f"omni-{tag}-a", f"vo{tag}a", "10.231.77.1"),
        "b": (f"omni-{tag}-b", f"vo{tag}b", "10.231.77.2"),
    }
    (ns_a, dev_a, _), (ns_b, dev_b, _) = hosts["a"], hosts["b"]
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for ns, dev, addr in hosts.values():
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns, _, _ in hosts.values():  # deleting a namespace deletes its veth end too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def rx_bytes(ns: str, dev: str) -> int:
    return int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"))


def test_nixl_across_two_simulated_hosts(two_hosts):
    (ns_a, dev_a, _), (ns_b, dev_b, _) = two_hosts["a"], two_hosts["b"]
    env = {"UCX_TLS": "tcp"}  # what a cross-node link without RDMA uses
    producer = PeerProcess(env={**env, "UCX_NET_DEVICES": dev_a}, netns=ns_a)
    consumer = PeerProcess(env={**env, "UCX_NET_DEVICES": dev_b}, netns=ns_b)
    try:
        producer.call("make", "nixl", "nixl-host-a", {})
        consumer.call("make", "nixl", "nixl-host-b", {})
        before = rx_bytes(ns_b, dev_b)
        for nbytes, seed in [(32 * 1024, 1), (8 * MiB + 5, 2)]:
            desc = producer.call("put_pattern", f"xhost-{nbytes}", nbytes, seed)
            assert consumer.call("get", desc, 30.0) == digest(pattern(nbytes, seed))
            consumer.call("release", desc)
        assert rx_bytes(ns_b, dev_b) - before >= 8 * MiB  # the payload came over the veth
        snap = consumer.call("stats")["roles"]["consumer"]
        assert snap["transfers"] == 2 and snap["bytes"] == 32 * 1024 + 8 * MiB + 5
        deadline = time.monotonic() + 5  # READ notifications free the producer's payloads
        while producer.call("pending") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert producer.call("pending") == 0
    finally:
        producer.close()
        consumer.close()
