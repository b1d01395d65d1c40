"""The edge channel's TCP form (connectors/edge_channel.py) over real sockets on loopback, and
the edge tokens' masking on the node link (orchestrator/edge_tokens.py). No stage processes:
milliseconds. The cross-node edge end to end: test_streamed_edges_nodes.py.

Checked: the token never goes on the wire (the EdgeHello carries a nonce instead); chunks and
credits flow sealed, in order; a frame altered, replayed, or sealed under another token closes
the channel before it is acted on; a producer closing right after its end marker, with credits
it never read, still delivers every chunk (the TCP drain); a masked Submit carries no token
and unmasks to the same one under the link's key only.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from vllm_omni_plugin.common.messages import GenerationParams, Submit
from vllm_omni_plugin.connectors.edge_channel import (
    MAC_BYTES,
    EdgeChunk,
    EdgeCredit,
    EdgeHello,
    EdgeLink,
    EdgeListener,
    EdgeNonce,
    FrameSeal,
    connect,
    decode_frame,
    new_nonce,
)
from vllm_omni_plugin.orchestrator.edge_tokens import mask_tokens, unmask_tokens

TOKEN = "5f2c8a0e9b7d4c1a3e6f8b2d0c9a7e5f"


class End:
    """One side's messages and loss, as its link reports them."""

    def __init__(self):
        self.messages: list = []
        self.lost: list[str] = []
        self.changed = asyncio.Event()

    def on_message(self, msg) -> None:
        self.messages.append(msg)
        self.changed.set()

    def on_lost(self, why: str) -> None:
        self.lost.append(why)
        self.changed.set()

    async def until(self, predicate, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


async def accepted(listener: EdgeListener) -> socket.socket:
    loop = asyncio.get_running_loop()
    got: asyncio.Future[socket.socket] = loop.create_future()
    listener.start(loop, lambda sock: got.done() or got.set_result(sock))
    return await asyncio.wait_for(got, 5)


async def sealed_pair(token: str = TOKEN, consumer_token: str = TOKEN):
    """A producer and a consumer link through the handshake, both sealed."""
    loop = asyncio.get_running_loop()
    listener = EdgeListener("test", tcp_host="127.0.0.1")
    producer, consumer = End(), End()
    plink = EdgeLink(connect(listener.address), loop, producer.on_message, producer.on_lost)
    hello = EdgeHello("req-1", 0, 1, "", 4, new_nonce())
    plink.send(hello)
    plink.await_seal()
    clink = EdgeLink(await accepted(listener), loop, consumer.on_message, consumer.on_lost)
    listener.close()
    await consumer.until(lambda: consumer.messages)
    assert consumer.messages.pop(0) == hello
    nonce = new_nonce()
    clink.send(EdgeNonce(nonce))
    clink.hold()
    await producer.until(lambda: producer.messages)
    assert producer.messages.pop(0) == EdgeNonce(nonce)
    plink.set_seal(FrameSeal(token, hello, nonce, producer=True))
    clink.set_seal(FrameSeal(consumer_token, hello, nonce, producer=False))
    clink.release()
    return plink, clink, producer, consumer


async def test_the_token_never_goes_on_the_wire():
    loop = asyncio.get_running_loop()
    listener = EdgeListener("test", tcp_host="127.0.0.1")
    assert listener.address.startswith("tcp:127.0.0.1:")
    plink = EdgeLink(connect(listener.address), loop, lambda m: None, lambda w: None)
    hello = EdgeHello("req-1", 0, 1, "", 4, new_nonce())
    plink.send(hello)
    plink.await_seal()
    plink.send(EdgeChunk(0, b"queued until the seal"))
    raw = await accepted(listener)
    raw.setblocking(True)
    raw.settimeout(5)
    (size,) = struct.unpack("!I", raw.recv(4))
    first = decode_frame(raw.recv(size))
    assert isinstance(first, EdgeHello) and first.token == "" and len(first.nonce) == 16
    plink.set_seal(FrameSeal(TOKEN, hello, new_nonce(), producer=True))
    (size,) = struct.unpack("!I", raw.recv(4))
    sealed = raw.recv(size)
    assert TOKEN.encode() not in sealed and len(sealed) > MAC_BYTES
    assert decode_frame(sealed[:-MAC_BYTES]) == EdgeChunk(0, b"queued until the seal")
    plink.close()
    raw.close()
    listener.close()


async def test_sealed_chunks_and_credits_flow_in_order():
    plink, clink, producer, consumer = await sealed_pair()
    for seq in range(5):
        plink.send(EdgeChunk(seq, bytes([seq]) * 100))
    await consumer.until(lambda: len(consumer.messages) == 5)
    assert [m.seq for m in consumer.messages] == list(range(5))
    assert consumer.messages[3].payload == bytes([3]) * 100
    for seq in range(5):
        clink.send(EdgeCredit(seq))
    await producer.until(lambda: len(producer.messages) == 5)
    assert producer.messages == [EdgeCredit(s) for s in range(5)]
    assert not producer.lost and not consumer.lost
    plink.close()
    clink.close()


async def test_a_frame_under_another_token_closes_the_channel():
    plink, clink, producer, consumer = await sealed_pair(consumer_token="0" * 32)
    plink.send(EdgeChunk(0, b"x"))
    await consumer.until(lambda: consumer.lost)
    assert consumer.messages == [] and "does not verify" in consumer.lost[0]
    plink.close()


@pytest.mark.parametrize("attack", ["alter", "replay"])
async def test_an_altered_or_replayed_frame_closes_the_channel(attack):
    """A man in the middle forwards the producer's frames, changing one byte of the second
    (alter) or sending the first one twice (replay)."""
    loop = asyncio.get_running_loop()
    listener = EdgeListener("test", tcp_host="127.0.0.1")
    middle = EdgeListener("middle", tcp_host="127.0.0.1")
    producer, consumer = End(), End()
    plink = EdgeLink(connect(middle.address), loop, producer.on_message, producer.on_lost)
    from_producer = await accepted(middle)
    to_consumer = connect(listener.address)
    clink = EdgeLink(await accepted(listener), loop, consumer.on_message, consumer.on_lost)
    from_producer.setblocking(True)
    from_producer.settimeout(5)
    to_consumer.setblocking(True)

    hello = EdgeHello("req-1", 0, 1, "", 4, new_nonce())
    nonce = new_nonce()
    plink.seal = FrameSeal(TOKEN, hello, nonce, producer=True)  # handshake done off the wire
    clink.seal = FrameSeal(TOKEN, hello, nonce, producer=False)
    for seq in range(2):
        plink.send(EdgeChunk(seq, b"payload"))

    def frame() -> bytes:
        head = from_producer.recv(4, socket.MSG_WAITALL)
        (size,) = struct.unpack("!I", head)
        return head + from_producer.recv(size, socket.MSG_WAITALL)

    first, second = await asyncio.to_thread(frame), await asyncio.to_thread(frame)
    if attack == "alter":
        second = second[:-40] + bytes([second[-40] ^ 1]) + second[-39:]
        to_consumer.sendall(first + second)
    else:
        to_consumer.sendall(first + first)
    await consumer.until(lambda: consumer.lost)
    assert consumer.messages == [EdgeChunk(0, b"payload")]
    assert "does not verify" in consumer.lost[0]
    for closable in (plink, from_producer, to_consumer, listener, middle):
        closable.close()


async def test_closing_after_the_end_marker_delivers_every_chunk():
    """The producer closes at once after its end marker, with the consumer's credits unread
    in its socket: a plain TCP close would reset the connection and could lose the tail."""
    plink, clink, producer, consumer = await sealed_pair()
    payload = bytes(64 << 10)
    count = 64
    for seq in range(count):
        plink.send(EdgeChunk(seq, payload))
        if seq < 8:
            clink.send(EdgeCredit(seq))
    plink.send(EdgeChunk(count, end=True))
    await asyncio.sleep(0.05)  # the credits are in the producer's socket, unread
    plink.close(flush=True)
    await consumer.until(lambda: consumer.messages and consumer.messages[-1].end, timeout=10)
    assert [m.seq for m in consumer.messages] == list(range(count + 1))
    # After its end marker the producer ended its side: the consumer reads EOF (a stage's
    # input closes its own end at the marker, before that).
    clink.close()  # the consumer's close ends the producer's drain
    async with asyncio.timeout(5):
        while not plink.closed:
            await asyncio.sleep(0.01)
    assert not producer.lost  # its own close: never reported as a loss


def test_masked_tokens_unmask_under_the_link_key_only():
    msg = Submit(
        "req-1",
        GenerationParams("x"),
        stream_token=TOKEN,
        stream_tokens={0: "a" * 32},
        stream_to="tcp:10.0.0.2:4711",
    )
    key = b"k" * 32
    masked, nonce = mask_tokens(msg, key)
    assert TOKEN not in masked.stream_token and masked.stream_tokens[0] != "a" * 32
    assert unmask_tokens(masked, key, nonce) == msg
    again, nonce2 = mask_tokens(msg, key)
    assert nonce2 != nonce and again.stream_token != masked.stream_token
    try:
        other = unmask_tokens(masked, b"o" * 32, nonce)
    except ValueError:  # not even text under the wrong key
        return
    assert other.stream_token != TOKEN


def test_a_node_opens_tcp_listeners_for_streamed_inputs_only():
    from vllm_omni_plugin.config import load_deploy_config
    from vllm_omni_plugin.connectors.edge_channel import EDGE_TCP_HOST_ENV
    from vllm_omni_plugin.orchestrator.node import node_stage_inits

    omni = load_deploy_config("qwen3_omni_nodes_tiny")
    inits = node_stage_inits(omni, [1, 2], ("127.0.0.1", 29600))
    assert {sid: i.stage.env.get(EDGE_TCP_HOST_ENV) for sid, i in inits.items()} == {
        1: "127.0.0.1",
        2: "127.0.0.1",
    }
    glm = load_deploy_config("glm_image_tiny_nixl", model="/unused/glm-image")
    (dit,) = node_stage_inits(glm, [1], ("127.0.0.1", 29600)).values()
    assert EDGE_TCP_HOST_ENV not in dit.stage.env  # its edge goes over NIXL: nothing listens


async def test_a_refused_connection_is_the_channel_lost():
    """Nobody listens at the address (a consumer's node restarted on another port): the
    producer hears of it as of any lost peer, not by a blocked connect."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    producer = End()
    loop = asyncio.get_running_loop()
    link = EdgeLink(connect(f"tcp:127.0.0.1:{port}"), loop, producer.on_message, producer.on_lost)
    link.send(EdgeHello("req-1", 0, 1, "", 4, new_nonce()))
    await producer.until(lambda: producer.lost)
    assert link.closed
