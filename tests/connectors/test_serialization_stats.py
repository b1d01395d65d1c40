"""Payload encoding, the staging allocator, and the Prometheus export of connector counters."""

from __future__ import annotations

import gc
import logging

import msgspec
import pytest
import torch
from payload_structs import PriorSketch, Unregistered, evil_pickle
from prometheus_client import CollectorRegistry, generate_latest

from vllm_omni_plugin.common.messages import ConnectorSnapshot
from vllm_omni_plugin.connectors import (
    ConnectorError,
    make_connector,
    register_prometheus,
    set_remote_snapshot,
)
from vllm_omni_plugin.connectors.serialization import bytes_view, decode, encode
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


def test_bytes_and_structs():
    for payload in [b"", b"\x00\x01", bytearray(b"xyz"), memoryview(b"mv")]:
        enc = encode(payload)
        assert enc.kind == "bytes" and decode("bytes", None, enc.shape, enc.data.clone()) == bytes(
            payload
        )
    sketch = PriorSketch([1, 2, 3], 64, "é")
    enc = encode(sketch)
    assert (enc.kind, enc.dtype) == ("struct", "PriorSketch")
    assert decode("struct", "PriorSketch", enc.shape, enc.data.clone()) == sketch
    with pytest.raises(ConnectorError):
        decode("tensor", "not_a_dtype", (1,), torch.zeros(1, dtype=torch.uint8))


def test_no_other_payload_travels():
    """No pickle: a dict, an object or an unregistered struct cannot be sent at all."""
    for payload in ({"a": 1}, object(), Unregistered(1), [1, 2]):
        with pytest.raises(ConnectorError, match="cannot travel"):
            encode(payload)


def test_an_object_payload_is_refused_before_it_is_read(tmp_path, caplog):
    """A forged kind "object" whose bytes are a pickle that would create a file: refused with a
    logged error, and the file never appears. So is a struct name nobody registered."""
    marker = tmp_path / "ran"
    blob = evil_pickle(str(marker))
    with caplog.at_level(logging.ERROR, logger="vllm_omni_plugin.connectors"):
        with pytest.raises(ConnectorError, match="kind 'object' refused"):
            decode("object", None, (len(blob),), bytes_view(blob))
    assert not marker.exists()
    assert any("kind 'object' is not one of" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConnectorError, match="unknown type"):
        decode("struct", "Unregistered", (len(blob),), bytes_view(blob))
    assert not marker.exists()


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
    # As it crosses a link: the typed ConnectorSnapshot of the message schema, in msgpack.
    typed = msgspec.msgpack.decode(msgspec.msgpack.encode(remote), type=ConnectorSnapshot)
    set_remote_snapshot("node-1", [msgspec.to_builtins(typed)])
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
