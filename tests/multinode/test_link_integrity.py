"""Integrity of the node link after the key: real sockets, a real StageHead,
no stage processes.

* Every frame after the handshake carries a MAC under that connection's session keys: one bit
  flipped on the wire (by a TCP relay between a real node link and the head), a replayed frame,
  or a peer of the previous link version closes the connection; untampered traffic flows.
* The handshake, Register included, has one deadline (HANDSHAKE_DEADLINE_S) however slowly a
  peer sends, and one address holds at most MAX_HANDSHAKES_PER_ADDRESS handshake slots, while a
  real node registers meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time

import pytest
from link_peers import DIT, closed_by_peer, in_thread, register, running_head, until

from vllm_omni_plugin.common.link_messages import Heartbeat, Welcome
from vllm_omni_plugin.orchestrator import link as link_mod
from vllm_omni_plugin.orchestrator import remote
from vllm_omni_plugin.orchestrator.link import MAGIC, frame_mac
from vllm_omni_plugin.orchestrator.node_protocol import HANDSHAKE_DEADLINE_S


@pytest.fixture
async def head():
    async with running_head() as started:
        yield started


# ---- every frame after the handshake carries a MAC -------------------------------------------
class Relay:
    """A TCP relay between a node and the head: a man in the middle that can flip one byte of
    the next node -> head chunk (a whole small frame on loopback) after `flip_next()`."""

    def __init__(self, target_port: int, where: str = "message"):
        self.where = where  # which byte of the frame: of its length, message or MAC
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target = target_port
        self._flip = threading.Event()
        self.flipped = threading.Event()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def flip_next(self) -> None:
        self._flip.set()

    def _accept(self) -> None:
        try:
            node, _ = self.server.accept()
        except OSError:
            return
        head = socket.create_connection(("127.0.0.1", self.target))
        self.socks += [node, head]
        threading.Thread(target=self._pump, args=(node, head, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(head, node, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if tamper and self._flip.is_set() and len(chunk) > 4 + 8 + 32:
                    self._flip.clear()
                    data = bytearray(chunk)
                    at = {"length": 2, "message": 4 + 4, "mac": len(data) - 1}[self.where]
                    data[at] ^= 0x01  # one bit; in the length: 256 bytes more announced
                    chunk = bytes(data)
                    self.flipped.set()
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()
        for s in self.socks:
            s.close()


@pytest.mark.parametrize("where", ["message", "mac", "length"])
async def test_a_tampered_frame_closes_the_link_and_untampered_traffic_flows(head, caplog, where):
    h, client = head
    relay = Relay(h.port, where)
    try:
        link, reply = await register(relay.port)  # handshake, Register, Welcome via the relay
        assert isinstance(reply, Welcome)  # a MAC-checked frame head -> node
        await until(lambda: client.ready)
        (head_link,) = h.links
        for _ in range(5):  # untampered frames node -> head: read, accepted, link kept
            before = head_link.last_seen
            link.send(Heartbeat(DIT))
            await until(lambda before=before: head_link.last_seen > before)
        assert client.ready and client.deaths == 0 and head_link.alive

        relay.flip_next()
        for _ in range(25):  # heartbeats go on (a longer length swallows the next frames)
            if client.deaths:
                break
            with contextlib.suppress(BrokenPipeError):  # the relay closed the node's end
                link.send(Heartbeat(DIT))
            await asyncio.sleep(0.2)
        await until(lambda: client.deaths == 1)
        assert relay.flipped.is_set()
        assert not client.ready and not head_link.alive
        assert "tampered frame" in caplog.text and "failed its MAC" in caplog.text
        with pytest.raises((EOFError, OSError)):  # the node's end is closed too
            for _ in range(100):  # whatever the head sent before closing, then the end
                await in_thread(link.recv, 5.0)
        link.close()
        fresh, reply = await register(h.port)  # the head serves on
        assert isinstance(reply, Welcome)
        fresh.close()
    finally:
        relay.close()


async def test_a_replayed_frame_fails_its_mac(head):
    """The MAC covers each frame's sequence number: a recorded, valid frame sent again (or out
    of order) is refused like a forged one."""
    h, client = head
    link, _ = await register(h.port)
    await until(lambda: client.ready)
    frame = link_mod.encode(Heartbeat(DIT))
    link.sock.sendall(frame + frame_mac(link._send_key, link._send_seq - 1, frame))
    await until(lambda: client.deaths == 1)
    link.close()


async def test_an_old_peer_is_refused_at_the_greeting(head):
    h, _ = head
    assert MAGIC == b"vllm-omni-link/4"
    sock = socket.create_connection(("127.0.0.1", h.port), timeout=5)
    try:
        assert sock.recv(len(MAGIC)) == MAGIC
        sock.sendall(b"vllm-omni-link/3" + os.urandom(64))  # a node of the previous version
        assert await in_thread(closed_by_peer, sock)
    finally:
        sock.close()


# ---- the handshake: one deadline, slots per address ------------------------------------------
def trickle(port: int, source: str = "127.0.0.1") -> float:
    """Connect, read the head's greeting, then send a valid node greeting one byte a second.
    The seconds from connecting until the head closes the connection (inf: it never did)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    t0 = time.monotonic()
    try:
        sock.recv(len(MAGIC) + 32)
        for byte in MAGIC + os.urandom(32 + 32):  # 80 s of bytes at this pace
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return time.monotonic() - t0
            if closed_by_peer(sock, timeout=1.0):
                return time.monotonic() - t0
        return float("inf")
    finally:
        sock.close()


async def test_a_trickling_handshake_is_dropped_at_its_deadline_while_a_node_registers(head):
    """One byte a second renews any per-recv timeout forever; the whole handshake has one
    deadline (HANDSHAKE_DEADLINE_S, 5 s): dropped within 1.5 s of it, and a real node registers
    while the trickle is in progress."""
    h, client = head
    trickler = asyncio.ensure_future(in_thread(trickle, h.port))
    await asyncio.sleep(1.5)  # the trickle holds its slot
    assert not trickler.done()
    t0 = time.monotonic()
    link, reply = await register(h.port)
    assert isinstance(reply, Welcome) and time.monotonic() - t0 < 2.0
    await until(lambda: client.ready)
    held = await asyncio.wait_for(trickler, 20)
    assert HANDSHAKE_DEADLINE_S - 0.5 <= held <= HANDSHAKE_DEADLINE_S + 1.5, held
    assert client.ready  # the node's link was not touched by the trickle's end
    link.close()


async def test_handshake_slots_are_limited_per_address(head):
    """Connections from one address beyond MAX_HANDSHAKES_PER_ADDRESS are closed at once;
    another address (a node on another host; here 127.0.0.1 vs 127.0.0.2) still registers."""
    h, client = head
    silent = [
        socket.create_connection(("127.0.0.1", h.port), timeout=5, source_address=("127.0.0.2", 0))
        for _ in range(remote.MAX_HANDSHAKES_PER_ADDRESS)
    ]
    try:
        await asyncio.sleep(0.3)
        extra = socket.create_connection(
            ("127.0.0.1", h.port), timeout=5, source_address=("127.0.0.2", 0)
        )
        t0 = time.monotonic()
        with extra:
            assert await in_thread(closed_by_peer, extra, 2.0)
        assert time.monotonic() - t0 < 1.5  # at once, not at the deadline
        link, reply = await register(h.port)  # from 127.0.0.1: a slot of its own
        assert isinstance(reply, Welcome)
        link.close()
        for s in silent:  # each held its slot until the deadline, no longer
            assert await in_thread(closed_by_peer, s, HANDSHAKE_DEADLINE_S + 1.5)
    finally:
        for s in silent:
            s.close()
    await asyncio.sleep(0.3)
    assert h._per_address == {}  # every slot given back
    again = socket.create_connection(("127.0.0.1", h.port), source_address=("127.0.0.2", 0))
    with again:  # the address may authenticate again: greeted, not closed
        again.settimeout(2.0)
        assert again.recv(len(MAGIC)) == MAGIC
