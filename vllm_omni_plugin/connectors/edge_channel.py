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

The remote form, between stages on different nodes, keeps these messages over TCP
(`tcp:host:port`, a consumer on a headless node listening on the address its node reaches the
head from). Nobody's word is taken there, so the token never crosses the wire: it is the key.

    producer --EdgeHello(request, stages, window, nonce_p)--> consumer   in the clear
    consumer --EdgeNonce(nonce_c)----------------------------> producer  in the clear
    then every frame, both ways, sealed: length, msgpack, HMAC-SHA256 under a key of this
    connection and direction (FrameSeal: from the token and both nonces) over the frame's
    sequence number (counted, never sent) and body.

The consumer holds a connection's frames unread until it knows the request's token (its Submit
may come after the connection); the first frame that does not verify closes the channel, so a
peer without the token, or a frame altered, injected, replayed or reordered on the way, is
never acted on. The token itself reaches a node's stage masked under the node link's key
(orchestrator/edge_tokens.py): the link's messages are readable on the network, the token is
not. Frames are authenticated, not encrypted, as on the node link. Small chunks stay inline in
their frames (tokens, codec frames: bytes to KiB); a tensor chunk of at least the producer's
threshold (the thinker's hidden states for a prompt's media: megabytes) stays in the producer's
memory, registered with its NIXL agent, and its frame carries an EdgeNixlTensor instead: the
consumer READs the bytes into its own memory (GPU to GPU where both have one) and its credit
for that chunk lets the producer deregister them (connectors/edge_nixl.py). The descriptor
takes the chunk's place in the sequence and in the window like any chunk.

A TCP close with unread data resets the connection, which may discard what the peer has not
read yet: a TCP end that closes after its last message (the end marker, EdgeClose) shuts its
write side and reads on, discarding, until the peer closes too (at most DRAIN_TIMEOUT_S).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
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
NONCE_BYTES = 16
MAC_BYTES = 32
# A TCP end that closed its write side waits this long at most for the peer's close.
DRAIN_TIMEOUT_S = 10.0
# Set by a headless node for its stages: the address (its own, as the head sees it) on which
# a stage also listens for producers on other nodes.
EDGE_TCP_HOST_ENV = "OMNI_EDGE_TCP_HOST"


class EdgeHello(msgspec.Struct, tag=True):
    request_id: str
    from_stage: int
    to_stage: int
    token: str  # the orchestrator's per-request secret for this edge ("" over TCP: the key)
    window: int  # the most chunks the producer has out unconsumed
    nonce: bytes = b""  # over TCP: the producer's half of the connection's key


class EdgeNixlTensor(msgspec.Struct, frozen=True, tag=True):
    """Over TCP, a tensor chunk the consumer READs from the producer's memory with NIXL: the
    producer's agent (its metadata, and that of the region registered for this chunk) and
    where the bytes lie there."""

    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    agent_name: str
    incarnation: str
    agent_md: bytes
    region_md: bytes
    addr: int
    dev_id: int
    mem_type: str  # DRAM | VRAM


class EdgeChunk(msgspec.Struct, tag=True):
    seq: int
    payload: InlineTensor | EdgeNixlTensor | bytes | None = None
    end: bool = False  # the end marker: seq is the number of chunks before it


class EdgeCredit(msgspec.Struct, tag=True):
    seq: int


class EdgeClose(msgspec.Struct, tag=True):
    """The consumer finished its request without reading the rest: emit nothing more."""


class EdgeNonce(msgspec.Struct, tag=True):
    """Over TCP, the consumer's answer to an EdgeHello: its half of the connection's key."""

    nonce: bytes


EdgeMessage = EdgeHello | EdgeChunk | EdgeCredit | EdgeClose | EdgeNonce

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


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


class FrameSeal:
    """The MACs of one TCP connection's frames (see the module docstring): one key per
    direction, from the edge's token, the request and stages, and both sides' nonces; each
    frame's MAC covers its sequence number in that direction, so none can be replayed,
    reordered or dropped unnoticed."""

    def __init__(self, token: str, hello: EdgeHello, consumer_nonce: bytes, producer: bool):
        if not token or len(hello.nonce) != NONCE_BYTES or len(consumer_nonce) != NONCE_BYTES:
            raise EdgeChannelError("an edge over TCP needs its token and both nonces")
        context = _encoder.encode(
            ["omni-edge/1", hello.request_id, hello.from_stage, hello.to_stage, hello.window]
        )
        secret = token.encode()

        def key(direction: bytes) -> bytes:
            material = context + hello.nonce + consumer_nonce + direction
            return hmac.new(secret, material, hashlib.sha256).digest()

        to_consumer, to_producer = key(b"producer->consumer"), key(b"consumer->producer")
        self.send_key = to_consumer if producer else to_producer
        self.recv_key = to_producer if producer else to_consumer
        self.sent = 0
        self.received = 0

    def seal(self, body: bytes) -> bytes:
        mac = _mac(self.send_key, self.sent, body)
        self.sent += 1
        return mac

    def check(self, body: bytes | memoryview, mac: bytes | memoryview) -> None:
        if not hmac.compare_digest(_mac(self.recv_key, self.received, body), mac):
            raise EdgeChannelError("a frame that does not verify under the edge's key")
        self.received += 1


def _mac(key: bytes, seq: int, body: bytes | memoryview) -> bytes:
    h = hmac.new(key, struct.pack("!Q", seq), hashlib.sha256)
    h.update(body)
    return h.digest()


class EdgeLink:
    """One end of a connected channel, on an asyncio loop that it never blocks.

    `on_message(msg)` is called on the loop for each message, `on_lost(reason)` once when the
    peer closed the connection, died, or broke the protocol (never after our own `close`).
    Both may be replaced (the consumer's listener hands a link over after its EdgeHello).
    `on_closed()`, when set, is called once when this end closes, whatever the reason (what
    the peer may still read from us, e.g. NIXL registrations, is released there).

    Over TCP (`remote`) the frames after the handshake are sealed: a producer `await_seal`s
    after its EdgeHello (what it sends meanwhile waits, unencoded) and `set_seal`s on the
    EdgeNonce; a consumer `hold`s the frames after the EdgeHello unread until it knows the
    token, then `set_seal`s and `release`s them."""

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
        self.on_closed: Callable[[], None] | None = None
        self.remote = sock.family != socket.AF_UNIX
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.seal: FrameSeal | None = None
        self._fd = sock.fileno()
        self._buf = bytearray()
        self._unsent = bytearray()
        self._close_when_flushed = False
        self._waiting_seal: list[EdgeMessage] | None = None  # sends before the seal
        self._held = False
        self._draining: asyncio.TimerHandle | None = None
        loop.add_reader(self._fd, self._readable)

    # ---- the TCP handshake ---------------------------------------------------------------
    def await_seal(self) -> None:
        self._waiting_seal = []

    def set_seal(self, seal: FrameSeal) -> None:
        self.seal = seal
        queued, self._waiting_seal = self._waiting_seal or [], None
        for msg in queued:
            if self.closed:
                return
            self._send_frame(self._encode(msg))
        if self._close_when_flushed and not self._unsent:
            self.close(flush=True)  # closed while the handshake ran: now that all went out

    def hold(self) -> None:
        """Read no further frame until `release` (the bytes wait in the kernel's buffer)."""
        self._held = True
        if not self.closed:
            self.loop.remove_reader(self._fd)

    def release(self) -> None:
        if not self._held or self.closed:
            return
        self._held = False
        self.loop.add_reader(self._fd, self._readable)
        self.loop.call_soon(self._dispatch)  # what was read with the EdgeHello

    # ---- writing -------------------------------------------------------------------------
    def send(self, msg: EdgeMessage) -> None:
        """Queue one message (never blocks). EdgeChannelError once the link is closed or the
        peer stopped reading for MAX_UNSENT_BYTES."""
        if self.closed or self._close_when_flushed:
            raise EdgeChannelError("the channel is closed")
        if self._waiting_seal is not None:
            self._waiting_seal.append(msg)
            return
        self._send_frame(self._encode(msg))

    def _encode(self, msg: EdgeMessage) -> bytes:
        if self.seal is None:
            return encode_frame(msg)
        body = _encoder.encode(msg)
        mac = self.seal.seal(body)
        return struct.pack("!I", len(body) + MAC_BYTES) + body + mac

    def _send_frame(self, frame: bytes) -> None:
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
        except OSError:
            # The peer is gone (or a TCP connect was refused): the read side reports it, after
            # what the peer sent before it went (its last chunks, its end marker).
            return
        if n < len(frame):
            self._unsent += memoryview(frame)[n:]
            self.loop.add_writer(self._fd, self._flush)

    def _flush(self) -> None:
        try:
            n = self.sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # as in _send_frame: the read side reports it
            n = len(self._unsent)
        del self._unsent[:n]
        if not self._unsent:
            self.loop.remove_writer(self._fd)
            if self._close_when_flushed:
                self.close(flush=True)

    def close(self, flush: bool = False) -> None:
        """Close this end (idempotent). `flush`: once what was sent left (the end marker);
        else at once, dropping what is unsent (an abort)."""
        if self.closed:
            return
        if flush and (self._unsent or self._waiting_seal is not None):
            self._close_when_flushed = True
            return
        if flush and self.remote and self._draining is None:
            self._drain()
            return
        self.closed = True
        if self._draining is not None:
            self._draining.cancel()
        self.loop.remove_reader(self._fd)
        if self._unsent:
            self._unsent.clear()
            self.loop.remove_writer(self._fd)
        self._buf.clear()
        self._waiting_seal = None
        self.sock.close()
        on_closed, self.on_closed = self.on_closed, None
        if on_closed is not None:
            try:
                on_closed()
            except Exception:  # a handler's bug must not leave the close half done
                logger.exception("edge channel: on_closed failed")

    def _drain(self) -> None:
        """TCP: end our side, read (and drop) until the peer's close, then close."""
        self._close_when_flushed = True
        self._waiting_seal = None
        self._buf.clear()
        self._draining = self.loop.call_later(DRAIN_TIMEOUT_S, self.close)
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.close()
            return
        if self._held:
            self._held = False
            self.loop.add_reader(self._fd, self._readable)

    # ---- reading -------------------------------------------------------------------------
    def _readable(self) -> None:
        try:
            data = self.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(f"channel error: {exc}")
            return
        if self._draining is not None:
            if not data:
                self.close()
            return  # what the peer still sends after our end: nobody reads it
        if not data:
            self._lose("the peer closed the channel")
            return
        self.bytes_received += len(data)
        self._buf += data
        self._dispatch()

    def _dispatch(self) -> None:
        try:
            while not self.closed and not self._held and self._draining is None:
                msg = self._next_message()
                if msg is None:
                    return
                self.on_message(msg)
        except (EdgeChannelError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._lose(f"protocol error: {exc}")

    def _next_message(self) -> EdgeMessage | None:
        buf = self._buf
        if len(buf) < 4:
            return None
        (size,) = struct.unpack_from("!I", buf, 0)
        if size > MAX_FRAME_BYTES:
            raise EdgeChannelError(f"a {size}-byte frame (at most {MAX_FRAME_BYTES})")
        if len(buf) < 4 + size:
            return None
        if self.seal is None:
            msg = decode_frame(memoryview(buf)[4 : 4 + size])
        else:
            if size < MAC_BYTES:
                raise EdgeChannelError("a sealed frame without its MAC")
            body = bytes(buf[4 : 4 + size - MAC_BYTES])  # TCP chunks are small: one copy
            self.seal.check(body, bytes(buf[4 + size - MAC_BYTES : 4 + size]))
            msg = decode_frame(body)
        del buf[: 4 + size]
        return msg

    def _lose(self, reason: str) -> None:
        if self.closed:
            return
        draining = self._draining is not None
        self.close()
        if draining:  # we were closing anyway
            return
        try:
            self.on_lost(reason)
        except Exception:  # a handler's bug must not take the loop's reader down
            logger.exception("edge channel: on_lost failed")


# ---- addresses: where a consumer listens -----------------------------------------------------
def _unix_path(address: str) -> str:
    kind, _, rest = address.partition(":")
    if kind != "unix" or not rest.startswith("@"):
        raise ValueError(f"edge address {address!r}: expected unix:@name or tcp:host:port")
    return "\0" + rest[1:]


def tcp_host_port(address: str) -> tuple[str, int]:
    """`tcp:10.0.0.2:4711` / `tcp:[::1]:4711` -> (host, port); ValueError otherwise."""
    kind, _, rest = address.partition(":")
    host, sep, port = rest.rpartition(":")
    if kind != "tcp" or not sep or not host or not port.isdigit():
        raise ValueError(f"edge address {address!r}: expected tcp:host:port")
    return host.strip("[]"), int(port)


def is_tcp(address: str) -> bool:
    return address.startswith("tcp:")


def tcp_address(host: str, port: int) -> str:
    return f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"


class EdgeListener:
    """A consumer stage's listening end: `address` is what its producers connect to. Created
    before the loop runs (the address goes out in the stage's Ready); `start` serves it.

    Local (`tcp_host` None): a Unix socket in the abstract namespace, for peers of this user
    (SO_PEERCRED). `tcp_host`: a TCP port on that address, for producers on other nodes, who
    prove the request's token with every frame (the module docstring)."""

    def __init__(self, name_hint: str, tcp_host: str | None = None):
        if tcp_host is None:
            name = f"omni-edge-{name_hint}-{os.getpid()}-{secrets.token_hex(8)}"
            self.address = f"unix:@{name}"
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(_unix_path(self.address))
        else:
            family = socket.AF_INET6 if ":" in tcp_host else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.bind((tcp_host, 0))
            self.address = tcp_address(tcp_host, self.sock.getsockname()[1])
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
            if conn.family == socket.AF_UNIX:
                if not _same_user(conn):
                    conn.close()
                    continue
            else:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
    """A socket connecting to a consumer's `address` (OSError when nobody listens there). It
    never waits: a local connect completes at once (the listener's backlog takes it), a TCP
    one completes in the background (what is sent meanwhile waits; a refusal or an
    unreachable host is the channel's loss)."""
    if is_tcp(address):
        host, port = tcp_host_port(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex((host, port))
            if code not in (0, errno.EINPROGRESS):
                raise OSError(code, os.strerror(code))
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(_unix_path(address))
    except BaseException:
        sock.close()
        raise
    return sock
