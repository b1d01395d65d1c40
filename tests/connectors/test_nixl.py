"""NIXL connector between two real processes over loopback (UCX on `lo`).

The producer is a subprocess (tests/connectors/conn_peer.py); the consumer is this test process.
"""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest
import torch
from conn_peer import digest, pattern
from conn_peerctl import PeerError, PeerProcess
from payload_structs import PriorSketch

from vllm_omni_plugin.connectors import ConnectorError, ConnectorTimeout, make_connector

MiB = 1 << 20
SIZES = [1, 2, 255, 4096, 32 * 1024, MiB, MiB + 1, 7 * MiB + 13, 64 * MiB]


@pytest.fixture(scope="module")
def consumer():
    conn = make_connector("nixl", name="nixl-consumer")
    yield conn
    conn.close()


@pytest.fixture(scope="module")
def producer():
    peer = PeerProcess()
    peer.call("make", "nixl", "nixl-producer", {})
    yield peer
    peer.close()


# A bound for conditions that hold within milliseconds on an idle machine (a notification
# processed, a lease counted): far above what a loaded 2-core machine delays another process
# by, so that only a condition that never comes fails. Waiting ends as soon as it holds.
CONDITION_BOUND_S = 60.0


def wait_for(predicate, timeout: float = CONDITION_BOUND_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("nbytes", SIZES)
def test_bytes_exact(producer, consumer, nbytes):
    desc = producer.call("put_pattern", f"req-{nbytes}", nbytes, nbytes)
    assert len(msgspec.msgpack.encode(desc)) < 2048  # small whatever the payload
    got = consumer.get(desc, timeout=30)
    consumer.release(desc)
    assert got.dtype == torch.uint8 and got.shape == (nbytes,)
    assert torch.equal(got, pattern(nbytes, nbytes))


def test_send_pool_payload_is_exact_and_needs_no_registration(producer, consumer):
    """A payload built in the producer's empty(): no per-put registration, slot freed after use."""
    base = producer.call("send_pool_used")
    nbytes = 64 * MiB + 3
    desc = producer.call("put_pattern_pooled", "req-pooled", nbytes, 7)
    assert desc.location.region_md is None  # lies in the pool registered at start-up
    assert producer.call("send_pool_used") > base
    got = consumer.get(desc, timeout=30)
    consumer.release(desc)
    assert torch.equal(got, pattern(nbytes, 7))
    # The READ's notification ends the lease, which held the last reference to the tensor.
    assert wait_for(lambda: producer.call("send_pool_used") == base)
    # A late get of the same descriptor is refused instead of returning reused bytes.
    with pytest.raises(ConnectorError):
        consumer.get(desc, timeout=5)


def test_payload_types_roundtrip(producer, consumer):
    payloads = [
        torch.arange(24, dtype=torch.float16).reshape(4, 6)[:, ::2],  # non-contiguous
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.tensor([True, False, True]),
        torch.empty(0, 4),
        b"raw bytes \x00\xff",
        b"",
        PriorSketch(list(range(10)), 64, "x" * 3000),
    ]
    for i, payload in enumerate(payloads):
        desc = producer.call("put", f"types-{i}", payload)
        got = consumer.get(desc, timeout=10)
        consumer.release(desc)
        if isinstance(payload, torch.Tensor):
            assert got.dtype == payload.dtype and got.shape == payload.shape
            assert torch.equal(got, payload)
        elif isinstance(payload, bytes):
            assert got == payload
        else:
            assert got == payload


def test_producer_frees_on_read_and_on_release(producer, consumer):
    desc = producer.call("put_pattern", "free-read", 1000, 1)
    consumer.get(desc, timeout=10)
    assert wait_for(lambda: producer.call("pending") == 0), (
        "READ notification did not free the payload"
    )
    # Released without a get (an aborted request): the notification path frees it too.
    desc = producer.call("put_pattern", "free-abort", 5 * MiB, 2)
    assert producer.call("pending") == 1
    consumer.release(desc)
    assert wait_for(lambda: producer.call("pending") == 0), (
        "release notification did not free the payload"
    )
    snap = producer.call("stats")
    assert snap["roles"]["producer"]["transfers"] >= 2


def test_lease_expiry_frees_and_late_get_fails(consumer):
    # Two agents in this process are enough: expiry is the producer's own bookkeeping.
    producer = make_connector("nixl", name="nixl-lease", lease_s=0.3)
    try:
        desc = producer.put("lease", 0, 1, pattern(4096, 3))
        # The lease leaves `pending` before its expiry is counted: wait for both.
        assert wait_for(
            lambda: producer.pending() == 0 and producer.stats.snapshot()["expired"] == 1
        ), producer.stats.snapshot()
        with pytest.raises(ConnectorError, match="lease expired"):
            consumer.get(desc, timeout=5)
    finally:
        producer.close()


def test_dead_peer_is_a_clear_error_within_deadline(consumer):
    peer = PeerProcess()
    stranger = make_connector("nixl", name="nixl-stranger")  # never talked to the peer
    try:
        peer.call("make", "nixl", "nixl-dead", {})
        warm = peer.call("put_pattern", "warm", 64, 4)
        consumer.get(warm, timeout=10)  # connection established
        descs = [
            peer.call("put_pattern", "dead-small", 32 * 1024, 5),
            peer.call("put_pattern", "dead-big", 4 * MiB, 6),
        ]
        peer.kill()
        for conn, desc in [(consumer, descs[0]), (consumer, descs[1]), (stranger, descs[0])]:
            start = time.monotonic()
            with pytest.raises(ConnectorError) as err:
                conn.get(desc, timeout=5)
            assert time.monotonic() - start < 5.5
            assert "nixl" in str(err.value).lower()
    finally:
        stranger.close()
        peer.close()
    assert consumer.health()


def _wait_all_threads_stopped(pid: int, within_s: float = 5.0) -> None:
    """SIGSTOP is delivered asynchronously: wait until every thread of `pid` (UCX's progress
    thread among them) is in the stopped state."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop: thread states {states}")


def test_hung_peer_hits_deadline(monkeypatch):
    # Over TCP (the cross-node case) a READ needs the peer's progress thread; on one host UCX may
    # read a stopped process's memory directly (cma), which is then a correct, finished READ.
    monkeypatch.setenv("UCX_TLS", "tcp")
    consumer = make_connector("nixl", name="nixl-consumer-tcp")
    monkeypatch.delenv("UCX_TLS")
    peer = PeerProcess(env={"UCX_TLS": "tcp"})
    try:
        peer.call("make", "nixl", "nixl-hung", {})
        consumer.get(peer.call("put_pattern", "warm", 64, 8), timeout=10)
        descs = [
            peer.call("put_pattern", "hung", 2 * MiB, 9),
            peer.call("put_pattern", "hung-small", 4096, 10),
        ]
        os.kill(peer.pid, signal.SIGSTOP)
        _wait_all_threads_stopped(peer.pid)
        for desc in descs:
            start = time.monotonic()
            with pytest.raises(ConnectorTimeout, match="did not finish within"):
                consumer.get(desc, timeout=1.5)
            elapsed = time.monotonic() - start
            assert 1.5 <= elapsed < 2.5
        assert consumer.stats.snapshot()["timeouts"] == 2
        assert consumer.health()
    finally:
        peer.kill()
        peer.close()
        consumer.close()


def test_rehandshake_after_peer_restart(consumer):
    # Same agent name across the restart: only the incarnation in the descriptor changes.
    options = {"agent_name": "omni-restart-test-producer"}
    first = PeerProcess()
    try:
        first.call("make", "nixl", "nixl-restart", options)
        desc = first.call("put_pattern", "before", 32 * 1024, 10)
        assert digest(consumer.get(desc, timeout=10)) == digest(pattern(32 * 1024, 10))
    finally:
        first.kill()
        first.close()
    second = PeerProcess()
    try:
        second.call("make", "nixl", "nixl-restart", options)
        for i in range(3):
            desc = second.call("put_pattern", f"after-{i}", 3 * MiB, 11 + i)
            assert torch.equal(consumer.get(desc, timeout=10), pattern(3 * MiB, 11 + i))
            consumer.release(desc)
    finally:
        second.close()


def test_bad_timeout_and_foreign_descriptor(producer, consumer):
    desc = producer.call("put_pattern", "bad", 10, 1)
    with pytest.raises(ValueError):
        consumer.get(desc, timeout=0)
    shm = make_connector("shm", name="shm-foreign")
    try:
        with pytest.raises(ConnectorError, match="made by a 'nixl' connector"):
            shm.get(desc, timeout=1)
    finally:
        shm.close()
    consumer.release(desc)


def test_peer_reports_errors_typed(producer):
    with pytest.raises(PeerError) as err:
        producer.call("get", "not a descriptor", 1.0)
    assert err.value.kind == "ConnectorError"


def test_idle_connector_does_not_spin(consumer):
    # NIXL's own progress thread busy-polls (a whole core per idle agent); ours sleeps 20 us.
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert consumer.health()
    assert cpu < 0.3, f"an idle NIXL connector used {cpu:.2f} s of CPU in 1 s"


def test_region_reregistered_at_a_loaded_address_reloads_the_peer(producer, consumer, monkeypatch):
    """A device payload re-registered where an earlier one lay gets a new key (CUDA memory; host
    memory keeps its key, so this machine cannot make the clash itself): NIXL then refuses the
    region with NIXL_ERR_NOT_ALLOWED, as it did at the 64 MiB handoff on an H200. That refusal
    is injected here, once, into the real agent; the consumer must reload the peer and read the
    exact bytes."""
    from nixl._bindings import nixlNotAllowedError

    warm = producer.call("put_pattern", "clash-warm", 3 * MiB, 20)
    assert torch.equal(consumer.get(warm, timeout=10), pattern(3 * MiB, 20))
    consumer.release(warm)
    nixl = consumer.agent.agent
    real_add, calls = nixl.add_remote_agent, []

    def refuse_region_once(metadata):
        calls.append(metadata)
        if len(calls) == 1:
            raise nixlNotAllowedError("NIXL_ERR_NOT_ALLOWED")
        return real_add(metadata)

    monkeypatch.setattr(nixl, "add_remote_agent", refuse_region_once)
    desc = producer.call("put_pattern", "clash", 3 * MiB, 21)
    assert torch.equal(consumer.get(desc, timeout=10), pattern(3 * MiB, 21))
    consumer.release(desc)
    # refused region, the peer's full metadata, the region again
    assert len(calls) == 3 and calls[1] == desc.location.agent_md
    monkeypatch.undo()
    after = producer.call("put_pattern", "clash-after", 3 * MiB, 22)
    assert torch.equal(consumer.get(after, timeout=10), pattern(3 * MiB, 22))
    consumer.release(after)
