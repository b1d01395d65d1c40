"""In-process and shared-memory connectors (shm between two real processes)."""

from __future__ import annotations

import gc
import os
import time

import msgspec
import pytest
import torch
from conn_peer import pattern
from conn_peerctl import PeerProcess
from payload_structs import PriorSketch, evil_pickle

from vllm_omni_plugin.connectors import ConnectorError, make_connector

MiB = 1 << 20


def test_inproc_hands_over_the_object():
    conn = make_connector("inproc", name="inproc-test")
    t = torch.randn(4, 4)
    desc = conn.put("r", 0, 1, t)
    assert desc.kind == "tensor" and desc.shape == (4, 4) and desc.nbytes == 64
    assert conn.get(desc, timeout=1) is t  # same process: no copy
    assert conn.get(desc, timeout=1) is t  # gets are repeatable until release
    conn.release(desc)
    assert conn.pending() == 0
    with pytest.raises(ConnectorError, match="unknown"):
        conn.get(desc, timeout=1)
    desc = conn.put("r", 0, 1, bytearray(b"abc"))
    assert conn.get(desc, timeout=1) == b"abc"
    obj = PriorSketch([1, 2], 64, "x")
    assert conn.get(conn.put("r", 1, 2, obj), timeout=1) is obj
    with pytest.raises(ConnectorError, match="cannot travel"):
        conn.put("r", 1, 2, {"k": [1, 2]})  # payloads are tensors, bytes or typed structs
    snap = conn.stats.snapshot()
    assert snap["puts"] == 3 and snap["roles"]["consumer"]["transfers"] == 4
    assert (
        snap["roles"]["producer"]["transfers"] == 1 and snap["roles"]["consumer"]["failures"] == 1
    )
    conn.close()


def test_inproc_lease_expiry():
    conn = make_connector("inproc", name="inproc-lease", lease_s=0.05)
    desc = conn.put("r", 0, 1, b"x")
    time.sleep(0.1)
    assert conn.pending() == 0
    with pytest.raises(ConnectorError):
        conn.get(desc, timeout=1)
    assert conn.stats.snapshot()["expired"] == 1


@pytest.fixture(scope="module")
def shm_producer():
    peer = PeerProcess()
    peer.call("make", "shm", "shm-producer", {})
    yield peer
    peer.close()


@pytest.mark.parametrize("nbytes", [1, 4096, 32 * 1024, MiB + 1, 64 * MiB])
def test_shm_bytes_exact_across_processes(shm_producer, nbytes):
    conn = make_connector("shm", name="shm-consumer")
    desc = shm_producer.call("put_pattern", "shm", nbytes, nbytes)
    got = conn.get(desc, timeout=10)
    conn.release(desc)
    assert not os.path.exists(desc.location)  # release unlinks the file...
    assert torch.equal(got, pattern(nbytes, nbytes))  # ...and the tensor stays valid
    got.add_(1)  # the consumer owns the (unlinked) file's pages: writable
    assert torch.equal(got, pattern(nbytes, nbytes).add_(1))
    assert shm_producer.call("pending") == 0


def test_shm_types_and_errors(shm_producer):
    conn = make_connector("shm", name="shm-consumer")
    payload = PriorSketch([0, 1, 2, 3, 4, 5], 64, "é")
    desc = shm_producer.call("put", "obj", payload)
    assert desc.kind == "struct"
    got = conn.get(desc, timeout=5)
    assert got == payload
    conn.release(desc)
    with pytest.raises(ConnectorError, match="not readable"):
        conn.get(desc, timeout=5)  # released
    desc = shm_producer.call("put", "bytes", b"")
    assert conn.get(desc, timeout=5) == b""
    conn.release(desc)
    forged = msgspec.structs.replace(desc, location="/etc/passwd")
    with pytest.raises(ConnectorError, match="does not name an omni shm file"):
        conn.get(forged, timeout=5)
    conn.release(forged)  # must not unlink anything outside our files
    assert os.path.exists("/etc/passwd")


def test_shm_refuses_an_object_payload_before_reading_it(shm_producer, tmp_path):
    """A real shm file holding a pickle that would create a file, described as kind "object"
    (what the old encoding produced and a peer could forge): refused, the file never made."""
    marker = tmp_path / "ran"
    blob = evil_pickle(str(marker))
    desc = shm_producer.call("put", "evil", blob)  # the bytes, in a real omni shm file
    forged = msgspec.structs.replace(desc, kind="object")
    conn = make_connector("shm", name="shm-consumer")
    with pytest.raises(ConnectorError, match="kind 'object' refused"):
        conn.get(forged, timeout=5)
    assert not marker.exists()
    assert conn.get(desc, timeout=5) == blob  # the honest descriptor still reads: bytes
    conn.release(desc)


def test_shm_orphans_of_dead_producers_are_removed():
    peer = PeerProcess()
    try:
        peer.call("make", "shm", "shm-orphan", {})
        desc = peer.call("put_pattern", "orphan", 4096, 1)
        assert os.path.exists(desc.location)
        peer.kill()
    finally:
        peer.close()
    make_connector("shm", name="shm-sweeper").close()
    assert not os.path.exists(desc.location)


def test_shm_lease_expiry_in_producer():
    conn = make_connector("shm", name="shm-lease", lease_s=0.05)
    desc = conn.put("r", 0, 1, torch.ones(10))
    time.sleep(0.1)
    assert conn.pending() == 0 and not os.path.exists(desc.location)
    conn.close()
    gc.collect()


def test_shm_put_looks_at_the_oldest_leases_only(tmp_path):
    """A put notices the releases at the old end of its leases (consumers release in order)
    and stops at the first lease still held, so its cost does not grow with the leases out; a
    release out of order is noticed by the sweep of every lease (`full_sweep_s` apart)."""
    producer = make_connector("shm", name="shm-sweep", shm_dir=str(tmp_path))
    producer.full_sweep_s = 3600.0  # only the put's own sweep, until set to 0 below
    consumer = make_connector("shm", name="shm-sweep-reader", shm_dir=str(tmp_path))

    def released() -> int:
        return producer.stats.snapshot()["roles"]["producer"]["transfers"]

    def consume(desc) -> None:
        consumer.get(desc, timeout=1)
        consumer.release(desc)

    a, b, c = (producer.put("r", 0, 1, torch.zeros(4)) for _ in range(3))
    consume(b)  # out of order: a is still held
    producer.put("r", 0, 1, torch.zeros(4))
    assert released() == 0
    consume(a)
    producer.put("r", 0, 1, torch.zeros(4))
    assert released() == 2  # a, then b behind it; c is held
    d = producer.put("r", 0, 1, torch.zeros(4))
    consume(d)
    producer.put("r", 0, 1, torch.zeros(4))
    assert released() == 2
    producer.full_sweep_s = 0.0
    producer.put("r", 0, 1, torch.zeros(4))
    assert released() == 3
    assert producer.pending() == 5  # c and the four puts after it but d
    producer.close()
    consumer.close()
