"""The NIXL side of streamed edges across nodes (connectors/edge_nixl.py): two real NIXL agents
(UCX), a producer's and a consumer's, in this process; no stage, no network namespace (about a
second). The same code between two simulated hosts, under real stages:
tests/multinode/test_streamed_edges_nodes.py.

Checked: a chunk READ equals the producer's tensor bitwise, whatever its dtype and shape, and
is a copy taken at offer time; the producer holds each registration until released (one
chunk, a whole channel, or everything at close) and counts its bytes; its total bound sends a
chunk inline instead; a descriptor that does not add up is refused before any memory is
allocated, and a READ of memory the producer never registered fails (counted) instead of
returning bytes.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.connectors.base import ConnectorError
from vllm_omni_plugin.connectors.edge_channel import EdgeChunk, decode_frame, encode_frame
from vllm_omni_plugin.connectors.edge_nixl import EdgeNixl, edge_stats


@pytest.fixture(scope="module")
def pair():
    producer, consumer = EdgeNixl("test-producer"), EdgeNixl("test-consumer")
    yield producer, consumer
    producer.close()
    consumer.close()


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(37, 1024, generator=torch.Generator().manual_seed(1)),
        torch.randn(64, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
        torch.arange(3 * 5 * 4096, dtype=torch.int64).reshape(3, 5, 4096)[:, 1:4],  # a view
    ],
    ids=["float32", "bfloat16", "int64-strided"],
)
def test_a_chunk_read_equals_the_offered_tensor_bitwise(pair, tensor):
    producer, consumer = pair
    stats = edge_stats(7, 8, "nixl")
    reads = stats.snapshot()["roles"]["consumer"]["transfers"]
    ref = producer.offer(("req", 1), 0, tensor)
    assert ref is not None and ref.mem_type == "DRAM"
    # The descriptor crosses the edge in a frame of the closed schema.
    chunk = decode_frame(encode_frame(EdgeChunk(0, ref))[4:])
    assert chunk == EdgeChunk(0, ref)
    expected = bits(tensor)
    tensor.add_(1) if tensor.is_floating_point() else tensor.mul_(3)  # after the offer
    got = consumer.read(chunk.payload, stats)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert bits(got) == expected  # the value at offer time, bit for bit
    assert stats.snapshot()["roles"]["consumer"]["transfers"] == reads + 1
    assert producer.held_by(("req", 1)) == 1
    producer.release(("req", 1), 0)
    assert producer.held_by(("req", 1)) == 0 and producer.held_bytes == 0


def test_registrations_are_held_until_released_and_bounded(pair):
    producer, _ = pair
    chunk = torch.zeros(16 << 10, dtype=torch.float32)  # 64 KiB
    for seq in range(3):
        assert producer.offer(("a", 1), seq, chunk) is not None
    assert producer.offer(("b", 2), 0, chunk) is not None
    assert producer.held_bytes == 4 * chunk.nbytes
    producer.release(("a", 1), 1)
    assert producer.held_by(("a", 1)) == 2 and producer.held_bytes == 3 * chunk.nbytes
    producer.release_channel(("a", 1))
    assert producer.held_by(("a", 1)) == 0 and list(producer.held) == [(("b", 2), 0)]
    producer.release_channel(("b", 2))
    assert producer.held_bytes == 0

    bounded = EdgeNixl("test-bounded", max_held_bytes=2 * chunk.nbytes)
    try:
        assert bounded.offer(("c", 3), 0, chunk) is not None
        assert bounded.offer(("c", 3), 1, chunk) is not None
        assert bounded.offer(("c", 3), 2, chunk) is None  # over the bound: it goes inline
        assert bounded.held_bytes == 2 * chunk.nbytes
    finally:
        bounded.close()
    assert bounded.held == {} and bounded.held_bytes == 0  # close released everything


def test_a_descriptor_that_does_not_add_up_is_refused(pair):
    producer, consumer = pair
    stats = edge_stats(7, 9, "nixl")
    ref = producer.offer(("bad", 1), 0, torch.ones(32 << 10, dtype=torch.float16))
    assert ref is not None
    for forged in (
        ref.__class__(**{**_fields(ref), "nbytes": ref.nbytes + 2}),
        ref.__class__(**{**_fields(ref), "dtype": "not_a_dtype"}),
        ref.__class__(**{**_fields(ref), "shape": (-1, 2)}),
        ref.__class__(**{**_fields(ref), "shape": (1 << 20, 1 << 10), "nbytes": 2 << 30}),
        ref.__class__(**{**_fields(ref), "mem_type": "FILE"}),
    ):
        with pytest.raises(ConnectorError):
            consumer.read(forged, stats)
    # Memory the producer never registered (the first page): NIXL refuses the READ.
    unregistered = ref.__class__(**{**_fields(ref), "addr": 4096})
    with pytest.raises(ConnectorError):
        consumer.read(unregistered, stats)
    assert stats.snapshot()["roles"]["consumer"]["failures"] == 6
    # The real descriptor still reads (the peer is loaded afresh after the failure).
    assert bits(consumer.read(ref, stats)) == bits(torch.ones(32 << 10, dtype=torch.float16))
    producer.release_channel(("bad", 1))


def _fields(ref) -> dict:
    return {f: getattr(ref, f) for f in ref.__struct_fields__}
