"""A streamed edge's own channel: one request's chunks and credits, stage process to stage process.

A streamed edge (pipelines/topology.py `stream_output`) moves each chunk straight from the
producer's process to the consumer's, and the consumer's credit straight back; the API server
only hands both stages the consumer's address and a per-request token (stages/edge_streams.py
uses this module). One connection per request and edge:

    producer --EdgeHello(request, stages, token, window)--> consumer   first, once
    producer --EdgeChunk(seq, payload)--------------------> consumer   seq 0, 1, ...
    consumer --EdgeCredit(seq)----------------------------> producer   chunk seq consumed
    producer --EdgeChunk(seq=count, end=True)-------------> consumer   the stream ended
    consumer --EdgeClose()--------------------------------> producer   it reads no more

Each message is a msgpack frame (4-byte big-endian length, then a tagged struct of the closed
schema below: decoding builds only these, never an arbitrary object); a chunk's payload is the
tensor's raw bytes (InlineTensor) or bytes, inside its frame: no file, no descriptor, no
second copy through a connector.

The local form is a Unix stream socket in Linux's abstract namespace (`unix:@name`): nothing on
disk to leak when a stage is killed, and the kernel closes it with the process, so each side
reads EOF at once when the other dies. The listener accepts only peers of this user
(SO_PEERCRED) and the consumer checks each connection's token against its Submit.

Why a socket rather than a shared-memory ring: chunks here are tens of bytes to tens of KiB,
so a chunk's cost is waking the other process, not copying it. Measured on a 2-core CPU box
(benchmarks/bench_edge_transport.py), a 64-byte round trip takes ~9-10 us over a Unix socket
and ~5 us through shared memory woken by an eventfd; a chunk and its credit are one round trip,
while a chunk costs ~55-85 us end to end between two stage loops (benchmarks/
bench_stream_edges.py): the ring would save under a tenth. It would cost what the socket gives
for free: EOF the moment the peer dies (a ring needs a heartbeat or a pidfd), nothing left
behind by a SIGKILL (a ring's segment and eventfds need cleanup and a way to pass them between
unrelated processes), and per-request lifetime by close().

The remote form keeps these frames and changes only the address: `tcp:host:port` (or a NIXL
transfer for large payloads, the frame then carrying its descriptor) behind `EdgeListener` and
`connect`; `EdgeLink` does not know the address kind. Over TCP the producer must then shut
down its write side and drain credits before closing (a close with unread data resets a TCP
connection, where a Unix socket still delivers what was sent).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable

import msgspec

from ..common.payload import InlineTensor

logger = logging.getLogger("vllm_omni_plugin.connectors.edge_channel")

# One frame's bound (a chunk is a few KiB; a larger one is a broken or hostile peer).
MAX_FRAME_BYTES = 256 << 20
# Bytes one end may have written but the socket not yet taken: a window of chunks fits far
# below it; reached only by a peer that stopped reading.
MAX_UNSENT_BYTES = 512 << 20
READ_BYTES = 1 << 20
LISTEN_BACKLOG = 256


class EdgeHello(msgspec.Struct, tag=True):
    request_id: str
    from_stage: int
    to_stage: int
    token: str  # the orchestrator's per-request secret for this edge
    window: int  # the most chunks the producer has out unconsumed


class EdgeChunk(msgspec.Struct, tag=True):
    seq: int
    payload: InlineTensor | bytes | None = None
    end: bool = False  # the end marker: seq is the number of chunks before it


class EdgeCredit(msgspec.Struct, tag=True):
    seq: int


class EdgeClose(msgspec.Struct, tag=True):
    """The consumer finished its request without reading the rest: emit nothing more."""


EdgeMessage = EdgeHello | EdgeChunk | EdgeCredit | EdgeClose

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EdgeMessage)


class EdgeChannelError(RuntimeError):
    """The peer broke the channel's framing or schema."""


def encode_frame(msg: EdgeMessage) -> bytes:
    """One message as it goes on the wire: its length (4 bytes, big-endian), then msgpack."""
    data = _encoder.encode(msg)
    return struct.pack("!I", len(data)) + data


def decode_frame(data: bytes | memoryview) -> EdgeMessage:
    """The message of one frame's body (msgspec's DecodeError / ValidationError if it is
    outside the schema)."""
    return _decoder.decode(data)


class EdgeLink:
    """One end of a connected channel, on an asyncio loop that it never blocks.

    `on_message(msg)` is called on the loop for each message, `on_lost(reason)` once when the
    peer closed the connection, died, or broke the protocol (never after our own `close`).
    Both may be replaced (the consumer's listener hands a link over after its EdgeHello)."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[EdgeMessage], None],
        on_lost: Callable[[str], None],
    ):
        sock.setblocking(False)
        self.sock = sock
        self.loop = loop
        self.on_message = on_message
        self.on_lost = on_lost
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self._fd = sock.fileno()
        self._buf = bytearray()
        self._unsent = bytearray()
        self._close_when_flushed = False
        loop.add_reader(self._fd, self._readable)

    # ---- writing -------------------------------------------------------------------------
    def send(self, msg: EdgeMessage) -> None:
        """Queue one message (never blocks). EdgeChannelError once the link is closed or the
        peer stopped reading for MAX_UNSENT_BYTES."""
        if self.closed or self._close_when_flushed:
            raise EdgeChannelError("the channel is closed")
        frame = encode_frame(msg)
        self.bytes_sent += len(frame)
        if self._unsent:
            if len(self._unsent) + len(frame) > MAX_UNSENT_BYTES:
                raise EdgeChannelError(f"peer not reading ({len(self._unsent)} bytes unsent)")
            self._unsent += frame
            return
        try:
            n = self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:  # the peer is gone: its EOF on the read side reports it
            return
        if n < len(frame):
            self._unsent += memoryview(frame)[n:]
            self.loop.add_writer(self._fd, self._flush)

    def _flush(self) -> None:
        try:
            n = self.sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = len(self._unsent)
        del self._unsent[:n]
        if not self._unsent:
            self.loop.remove_writer(self._fd)
            if self._close_when_flushed:
                self.close()

    def close(self, flush: bool = False) -> None:
        """Close this end (idempotent). `flush`: once what was sent left (the end marker);
        else at once, dropping what is unsent (an abort)."""
        if self.closed:
            return
        if flush and self._unsent:
            self._close_when_flushed = True
            return
        self.closed = True
        self.loop.remove_reader(self._fd)
        if self._unsent:
            self._unsent.clear()
            self.loop.remove_writer(self._fd)
        self._buf.clear()
        self.sock.close()

    # ---- reading -------------------------------------------------------------------------
    def _readable(self) -> None:
        try:
            data = self.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(f"channel error: {exc}")
            return
        if not data:
            self._lose("the peer closed the channel")
            return
        self.bytes_received += len(data)
        self._buf += data
        try:
            for msg in self._messages():
                if self.closed:
                    return
                self.on_message(msg)
        except (EdgeChannelError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._lose(f"protocol error: {exc}")

    def _messages(self) -> list[EdgeMessage]:
        out = []
        buf = self._buf
        while len(buf) >= 4:
            (size,) = struct.unpack_from("!I", buf, 0)
            if size > MAX_FRAME_BYTES:
                raise EdgeChannelError(f"a {size}-byte frame (at most {MAX_FRAME_BYTES})")
            if len(buf) < 4 + size:
                break
            out.append(decode_frame(memoryview(buf)[4 : 4 + size]))
            del buf[: 4 + size]
        return out

    def _lose(self, reason: str) -> None:
        if self.closed:
            return
        self.close()
        try:
            self.on_lost(reason)
        except Exception:  # a handler's bug must not take the loop's reader down
            logger.exception("edge channel: on_lost failed")


# ---- addresses: where a consumer listens -----------------------------------------------------
def _unix_path(address: str) -> str:
    kind, _, rest = address.partition(":")
    if kind != "unix" or not rest.startswith("@"):
        raise ValueError(
            f"edge address {address!r}: only local channels (unix:@name) are built so far"
        )
    return "\0" + rest[1:]


class EdgeListener:
    """A consumer stage's listening end: `address` is what its producers connect to. Created
    before the loop runs (the address goes out in the stage's Ready); `start` serves it."""

    def __init__(self, name_hint: str):
        name = f"omni-edge-{name_hint}-{os.getpid()}-{secrets.token_hex(8)}"
        self.address = f"unix:@{name}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(_unix_path(self.address))
        self.sock.listen(LISTEN_BACKLOG)
        self.sock.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_accept: Callable[[socket.socket], None] | None = None

    def start(
        self, loop: asyncio.AbstractEventLoop, on_accept: Callable[[socket.socket], None]
    ) -> None:
        self._loop, self._on_accept = loop, on_accept
        loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._on_accept is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the producer sees a closed channel
                logger.error("edge listener: accept failed: %s", exc)
                return
            if not _same_user(conn):
                conn.close()
                continue
            self._on_accept(conn)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()


def _same_user(conn: socket.socket) -> bool:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.geteuid()


def connect(address: str) -> socket.socket:
    """A connected socket to a consumer's `address` (OSError when nobody listens there). A
    local connect completes at once (the listener's backlog takes it), so this never waits."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(_unix_path(address))
    except BaseException:
        sock.close()
        raise
    return sock
