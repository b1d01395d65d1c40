"""Payload encoding, the staging allocator, and the Prometheus export of connector counters."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from vllm_omni_plugin.connectors import (
    ConnectorError,
    make_connector,
    register_prometheus,
    set_remote_snapshot,
)
from vllm_omni_plugin.connectors.serialization import decode, encode
from vllm_omni_plugin.connectors.staging import StagingPool


@pytest.mark.parametrize(
    "payload",
    [
        torch.randn(2, 3, 4).transpose(0, 2),  # non-contiguous
        torch.arange(7, dtype=torch.int32),
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor(1.5, dtype=torch.float64),
        torch.zeros(0, 3),
    ],
)
def test_tensors_travel_raw(payload):
    enc = encode(payload)
    assert enc.kind == "tensor" and enc.nbytes == payload.numel() * payload.element_size()
    out = decode(enc.kind, enc.dtype, enc.shape, enc.data.clone())
    assert out.dtype == payload.dtype and torch.equal(out, payload)


def test_bytes_and_objects():
    for payload in [b"", b"\x00\x01", bytearray(b"xyz"), memoryview(b"mv")]:
        enc = encode(payload)
        assert enc.kind == "bytes" and decode("bytes", None, enc.shape, enc.data.clone()) == bytes(
            payload
        )
    obj = {"a": (1, 2.5, None), "t": torch.arange(3)}
    enc = encode(obj)
    assert enc.kind == "object"
    back = decode("object", None, enc.shape, enc.data.clone())
    assert back["a"] == obj["a"] and torch.equal(back["t"], obj["t"])
    with pytest.raises(ConnectorError):
        decode("tensor", "not_a_dtype", (1,), torch.zeros(1, dtype=torch.uint8))


def test_staging_pool_allocates_frees_and_coalesces():
    pool = StagingPool(4096)
    a, b, c = pool.alloc(1000), pool.alloc(1000), pool.alloc(1000)
    assert len({a, b, c}) == 3 and all(off % 256 == 0 for off in (a, b, c))
    assert pool.alloc(4096) is None  # too full
    pool.free(b)
    assert pool.alloc(1024) == b  # first fit reuses the hole
    for off in (a, b, c):
        pool.free(off)
    pool.free(a)  # double free is harmless
    assert pool.used_bytes() == 0 and pool.alloc(4096) == 0
    pool.free(0)
    # A leased view returns its slot when the last tensor using it dies.
    off = pool.alloc(512)
    view = pool.lease_view(off, 512)[256:].view(torch.float32)
    del off
    assert pool.used_bytes() == 512
    del view
    gc.collect()
    assert pool.used_bytes() == 0


def test_prometheus_export_with_connector_label():
    conn = make_connector("inproc", name="metrics-probe")
    for i in range(3):
        desc = conn.put(f"r{i}", 0, 1, torch.zeros(256, dtype=torch.uint8))
        conn.get(desc, timeout=1)
        conn.release(desc)
    with pytest.raises(ConnectorError):
        conn.get(desc, timeout=1)
    # Counters of another process (e.g. a headless stage node) arrive as snapshots.
    remote = make_connector("inproc", name="metrics-remote").stats.snapshot()
    remote["roles"]["consumer"]["transfers"] = 5
    set_remote_snapshot("node-1", [pickle.loads(pickle.dumps(remote))])
    registry = CollectorRegistry()
    register_prometheus(registry)
    register_prometheus(registry)  # idempotent
    text = generate_latest(registry).decode()
    assert 'omni_connector_transfers_total{connector="metrics-probe",role="consumer"} 3.0' in text
    assert 'omni_connector_transfers_total{connector="metrics-probe",role="producer"} 3.0' in text
    assert 'omni_connector_bytes_total{connector="metrics-probe",role="consumer"} 768.0' in text
    assert 'omni_connector_failures_total{connector="metrics-probe",role="consumer"} 1.0' in text
    assert 'omni_connector_puts_total{connector="metrics-probe"} 3.0' in text
    assert (
        'omni_connector_transfer_latency_seconds_count{connector="metrics-probe",role="consumer"} 3.0'
        in text
    )
    assert 'omni_connector_transfers_total{connector="metrics-remote",role="consumer"} 5.0' in text
    conn.close()
