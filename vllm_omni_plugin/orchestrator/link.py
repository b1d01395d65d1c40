"""One authenticated head <-> node connection, bridged into an asyncio loop.

Wire: after the handshake below, frames of a 4-byte big-endian length, one msgpack message of
common/messages.py's LINK union (typed msgspec structs; never pickle: decoding cannot run
code) and a 32-byte MAC: HMAC-SHA256 under this connection's key for that direction, over the
frame's sequence number (counted, never sent), length and message. A frame whose MAC fails
(rewritten, injected, replayed, reordered or dropped on the way) closes the link before it is
decoded. The frames are authenticated, not encrypted.

Handshake (both directions authenticated with the shared key, HMAC-SHA256; the role label in
each MAC keeps one side's proof from being replayed as the other's, fresh nonces from both
sides keep an old exchange from being replayed at all):
    head -> node  MAGIC + head_nonce
    node -> head  MAGIC + node_nonce + MAC(key, "node", head_nonce, node_nonce)
    head -> node  MAC(key, "head", head_nonce, node_nonce)      (only if the node's MAC held)
    session keys  one per direction, HMAC(key, "session", both nonces, direction): fresh for
                  every connection, so a frame of another connection never verifies on this one
Every pre-authentication read has a fixed size, and the whole exchange one deadline (not one
per recv, which a peer trickling a byte at a time would renew forever): a stranger holds a
connection for the head's HANDSHAKE_DEADLINE_S at most and never makes us allocate by its say-so.

Threads, not the event loop, touch the socket: a reader thread blocks in recv and hands each
message to the loop; `send()` only encodes and queues, and a writer thread does the blocking
write, so a slow or stalled peer can never block the API server's loop. A peer that lets more
than MAX_QUEUED_BYTES pile up is dropped. `close()` is idempotent and the loop hears `on_lost`
exactly once.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ..common.link_messages import decode_link
from ..common.messages import DecodeError
from ..common.messages import encode as encode_message
from .node_protocol import AUTHKEY_ENV

logger = logging.getLogger("vllm_omni_plugin.orchestrator.link")

MAGIC = b"vllm-omni-link/4"  # protocol name + version: a mismatch fails fast and says so
NONCE_BYTES = 32
MAC_BYTES = 32
HEADER = struct.Struct(">I")
SEQ = struct.Struct(">Q")
MAX_FRAME_BYTES = 256 << 20  # a Result with a batch of encoded images fits many times over
MAX_QUEUED_BYTES = 512 << 20  # unsent bytes before a peer that does not read is dropped
FLUSH_TIMEOUT_S = 2.0  # close(flush=True): how long a last message may take to leave


class AuthenticationError(ConnectionError):
    """The peer does not hold the key (or does not speak this protocol)."""


class UnreadableMessage(ValueError):
    """A frame that is too large or does not decode to a known message type."""


class TamperedFrame(UnreadableMessage):
    """A frame whose MAC does not verify under this connection's session key."""


class Session(NamedTuple):
    """An authenticated socket and this side's per-direction session keys (from the handshake)."""

    sock: socket.socket
    send_key: bytes
    recv_key: bytes


def frame_mac(key: bytes, seq: int, *frame: bytes) -> bytes:
    """The MAC that follows frame number `seq` (counted from 0 per direction) on the wire;
    `frame`: its bytes, whole or in parts (never joined: a large frame is not copied)."""
    mac = hmac.new(key, SEQ.pack(seq), hashlib.sha256)
    for part in frame:
        mac.update(part)
    return mac.digest()


def encode(msg: Any) -> bytes:
    """One frame for `msg` (a message of the LINK union). TypeError for anything else."""
    data = encode_message(msg)
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(
            f"{type(msg).__name__} is {len(data)} bytes, over the link's {MAX_FRAME_BYTES}-byte "
            "frame limit (payloads belong in a connector, not on the control link)"
        )
    return HEADER.pack(len(data)) + data


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with a deadline (time.monotonic()), all of them by then or TimeoutError,
    however the peer spreads them (a socket timeout alone bounds each recv, not the whole)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"deadline passed with {got} of {n} bytes read")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed by the peer")
        got += k
    return bytes(buf)


def read_message(sock: socket.socket, key: bytes, seq: int, deadline: float | None = None) -> Any:
    """Read frame number `seq` (whole by `deadline` when given), verify its MAC under `key`,
    decode it (EOFError, OSError, TimeoutError, TamperedFrame, UnreadableMessage)."""
    header = _read_exact(sock, HEADER.size, deadline)
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise UnreadableMessage(f"frame of {size} bytes announced (limit {MAX_FRAME_BYTES})")
    data = _read_exact(sock, size, deadline)
    mac = _read_exact(sock, MAC_BYTES, deadline)
    if not hmac.compare_digest(mac, frame_mac(key, seq, header, data)):
        raise TamperedFrame(f"frame {seq} failed its MAC (altered or injected on the way)")
    try:
        return decode_link(data)
    except DecodeError as exc:
        raise UnreadableMessage(str(exc)) from None


class Link:
    def __init__(self, session: Session, peer: str):
        self.sock = session.sock
        self.peer = peer
        self._send_key, self._recv_key = session.send_key, session.recv_key
        self._send_seq = 0  # only the writer thread counts these
        self._recv_seq = 0  # only one reader at a time: recv() before start_reader()
        self.last_seen = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self._queued = 0
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._refs = 2  # this handle + the writer; the reader adds one; the last closes the fd
        self._lost_reported = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_lost: Callable[[Link, str], None] | None = None
        threading.Thread(target=self._write, name=f"omni-link-w-{peer}", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._closed

    # ---- sending: any thread, never blocks on the socket -------------------------------
    def send(self, msg: Any) -> None:
        """Queue `msg` for the writer thread. BrokenPipeError when the link is closed (or
        its peer stopped reading); TypeError/ValueError when `msg` cannot go on the wire."""
        frame = encode(msg)
        with self._lock:
            if self._closed:
                raise BrokenPipeError(f"link to {self.peer} is closed")
            backlog = self._queued + len(frame) > MAX_QUEUED_BYTES
            if not backlog:
                self._queued += len(frame)
                self._out.put(frame)
        if backlog:
            self.drop(f"peer not reading ({self._queued} bytes unsent)")
            raise BrokenPipeError(f"link to {self.peer}: peer is not reading")

    def _write(self) -> None:
        why = None
        while True:
            item = self._out.get()
            if item is None:  # hard close
                break
            if item is _FLUSHED:  # close(flush=True): everything before it is out
                self._shutdown()
                break
            try:
                mac = frame_mac(self._send_key, self._send_seq, item)
                self._send_seq += 1
                if len(item) < 1 << 16:
                    self.sock.sendall(item + mac)  # one segment for a small message
                else:
                    self.sock.sendall(item)  # no copy of a large one
                    self.sock.sendall(mac)
            except OSError as exc:
                why = f"send failed ({exc})"
                break
            finally:
                with self._lock:
                    self._queued -= len(item)
        if why is not None:
            self.drop(why)
        self._unref()

    # ---- receiving ---------------------------------------------------------------------
    def recv(self, timeout: float) -> Any:
        """Blocking receive of one whole message within `timeout` seconds (only during
        registration, before start_reader)."""
        try:
            return self._read_one(time.monotonic() + timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{self.peer} sent no whole message within {timeout:.1f} s"
            ) from None
        finally:
            self.sock.settimeout(None)

    def _read_one(self, deadline: float | None = None) -> Any:
        msg = read_message(self.sock, self._recv_key, self._recv_seq, deadline)
        self._recv_seq += 1
        return msg

    def start_reader(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Link, Any], None],
        on_lost: Callable[[Link, str], None],
    ) -> None:
        self._loop, self._on_lost = loop, on_lost
        with self._lock:
            self._refs += 1
        threading.Thread(
            target=self._read, args=(on_message,), name=f"omni-link-r-{self.peer}", daemon=True
        ).start()

    def _read(self, on_message: Callable[[Link, Any], None]) -> None:
        assert self._loop is not None
        why = "connection closed"
        try:
            while True:
                msg = self._read_one()
                self.last_seen = time.monotonic()
                self._loop.call_soon_threadsafe(on_message, self, msg)
        except (EOFError, OSError):
            pass
        except TamperedFrame as exc:  # a man in the middle, or a peer without the session key
            why = f"tampered frame ({exc})"
            logger.warning("link %s: %s; closing the link", self.peer, why)
        except UnreadableMessage as exc:  # not our protocol, or a peer trying something
            why = f"unreadable message ({exc})"
            logger.warning("link %s: %s; dropping it", self.peer, why)
        except RuntimeError:  # the loop closed under us: the process is going down
            pass
        self.drop(why)
        self._unref()

    # ---- closing -----------------------------------------------------------------------
    def drop(self, why: str, flush: bool = False) -> None:
        """Close from our side (missed heartbeats, superseded, a bad message); the loop hears
        on_lost once. flush=True lets queued messages (a Rejected, a Superseded) go out first."""
        self._report_lost(why)
        self.close(flush=flush)

    def close(self, flush: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if flush:
            self._out.put(_FLUSHED)
            # A peer that does not read cannot hold the socket open past the deadline.
            timer = threading.Timer(FLUSH_TIMEOUT_S, self._shutdown)
            timer.daemon = True
            timer.start()
        else:
            self._shutdown()  # wakes the reader (recv) and the writer (sendall) at once
            self._out.put(None)
        self._unref()

    def _shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _unref(self) -> None:
        # The fd is closed only when no thread can still be inside a call on it, so a
        # recycled fd number is never read or written by a stale thread.
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.sock.close()

    def _report_lost(self, why: str) -> None:
        with self._lock:
            if self._lost_reported or self._loop is None:
                return
            self._lost_reported = True
        loop, on_lost = self._loop, self._on_lost
        if on_lost is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(on_lost, self, why)
            except RuntimeError:  # closed between the check and the call
                pass


_FLUSHED = object()


# ---- handshake -----------------------------------------------------------------------------
def _mac(key: bytes, role: bytes, head_nonce: bytes, node_nonce: bytes) -> bytes:
    return hmac.new(key, MAGIC + role + head_nonce + node_nonce, hashlib.sha256).digest()


def session_keys(key: bytes, head_nonce: bytes, node_nonce: bytes) -> tuple[bytes, bytes]:
    """(head->node, node->head) keys for one connection, from the shared key and both nonces."""
    base = MAGIC + b"session" + head_nonce + node_nonce
    to_node, to_head = (hmac.new(key, base + d, hashlib.sha256).digest() for d in (b"h>n", b"n>h"))
    return to_node, to_head


def _prepare(sock: socket.socket, timeout: float) -> float:
    """Set up `sock` for the handshake; the deadline that bounds the whole exchange."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)  # sends: small, but a peer that never reads cannot hold them
    return time.monotonic() + timeout


def connect(host: str, port: int, authkey: bytes, timeout: float) -> Session:
    """Connect to the head and authenticate both ways; the authenticated (blocking) session."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        deadline = _prepare(sock, timeout)
        try:
            magic = _read_exact(sock, len(MAGIC), deadline)
        except EOFError:
            raise ConnectionError(
                f"{host}:{port} closed the connection before its challenge"
            ) from None
        if magic != MAGIC:
            raise AuthenticationError(
                f"{host}:{port} is not a vllm-omni node registry of this version "
                f"(greeting {magic!r}, expected {MAGIC!r})"
            )
        head_nonce = _read_exact(sock, NONCE_BYTES, deadline)
        node_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + node_nonce + _mac(authkey, b"node", head_nonce, node_nonce))
        try:
            proof = _read_exact(sock, MAC_BYTES, deadline)
        except EOFError:
            raise AuthenticationError(
                f"the head at {host}:{port} refused this node's key: set the same "
                f"{AUTHKEY_ENV} on the head and every node"
            ) from None
        if not hmac.compare_digest(proof, _mac(authkey, b"head", head_nonce, node_nonce)):
            raise AuthenticationError(
                f"{host}:{port} could not prove it holds the key ({AUTHKEY_ENV} differs?)"
            )
        sock.settimeout(None)
        to_node, to_head = session_keys(authkey, head_nonce, node_nonce)
        return Session(sock, send_key=to_head, recv_key=to_node)
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, authkey: bytes, timeout: float) -> Session:
    """Authenticate an accepted socket, the whole exchange within `timeout` seconds however
    the peer spreads its bytes (AuthenticationError, EOFError, TimeoutError, OSError). The
    caller closes `sock` on failure."""
    deadline = _prepare(sock, timeout)
    head_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + head_nonce)
    # The greeting first: anything else (a pickle, HTTP, a port scanner) is refused at once.
    if _read_exact(sock, len(MAGIC), deadline) != MAGIC:
        raise AuthenticationError("not a vllm-omni node (bad greeting)")
    rest = _read_exact(sock, NONCE_BYTES + MAC_BYTES, deadline)
    node_nonce, mac = rest[:NONCE_BYTES], rest[NONCE_BYTES:]
    if not hmac.compare_digest(mac, _mac(authkey, b"node", head_nonce, node_nonce)):
        raise AuthenticationError(f"wrong key (the node's {AUTHKEY_ENV} differs)")
    sock.sendall(_mac(authkey, b"head", head_nonce, node_nonce))
    sock.settimeout(None)
    to_node, to_head = session_keys(authkey, head_nonce, node_nonce)
    return Session(sock, send_key=to_node, recv_key=to_head)
