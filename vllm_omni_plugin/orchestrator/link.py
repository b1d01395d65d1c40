"""One authenticated head <-> node connection, bridged into an asyncio loop.

A reader thread blocks in `recv()` and hands each message to the loop; `send()` may be called
from the loop (messages are small: descriptors, never payloads). `last_seen` feeds the missed-
heartbeat check; `close()` is idempotent and the loop hears `on_lost` exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

logger = logging.getLogger("vllm_omni_plugin.orchestrator.link")


class Link:
    def __init__(self, conn: Connection, peer: str):
        self.conn = conn
        self.peer = peer
        self.last_seen = time.monotonic()
        self._send_lock = threading.Lock()
        self._closed = False
        self._lost_lock = threading.Lock()
        self._lost_reported = False

    @property
    def alive(self) -> bool:
        return not self._closed

    def send(self, msg: Any) -> None:
        """Send or raise OSError (a closed or broken link)."""
        if self._closed:
            raise BrokenPipeError(f"link to {self.peer} is closed")
        with self._send_lock:
            self.conn.send(msg)

    def recv(self, timeout: float) -> Any:
        """Blocking receive with a deadline (used only during the handshake)."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.peer} sent nothing within {timeout:.0f} s")
        return self.conn.recv()

    def start_reader(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Link, Any], None],
        on_lost: Callable[[Link, str], None],
    ) -> None:
        def read() -> None:
            why = "connection closed"
            try:
                while True:
                    msg = self.conn.recv()
                    self.last_seen = time.monotonic()
                    loop.call_soon_threadsafe(on_message, self, msg)
            except (EOFError, OSError):
                pass
            except Exception as exc:  # unpicklable garbage: drop the peer
                why = f"unreadable message ({type(exc).__name__}: {exc})"
            self.close()
            self._report_lost(loop, on_lost, why)

        self._on_lost = on_lost
        self._loop = loop
        threading.Thread(target=read, name=f"omni-link-{self.peer}", daemon=True).start()

    def drop(self, why: str) -> None:
        """Close from our side (missed heartbeats, superseded); the loop hears on_lost once."""
        if hasattr(self, "_loop"):  # report before closing: the reader would say "closed"
            self._report_lost(self._loop, self._on_lost, why)
        self.close()

    def _report_lost(self, loop, on_lost, why: str) -> None:
        with self._lost_lock:
            if self._lost_reported:
                return
            self._lost_reported = True
        if not loop.is_closed():
            loop.call_soon_threadsafe(on_lost, self, why)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # shutdown() wakes the reader thread blocked in recv(); close() alone may not.
            sock = socket.socket(fileno=self.conn.fileno())
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()
        except OSError:
            pass
        try:
            self.conn.close()
        except OSError:
            pass


def _handshake_timeout(sock: socket.socket, seconds: float) -> None:
    """OS-level receive timeout: the handshake helpers do blocking reads on the raw fd."""
    whole = int(seconds)
    tv = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def _wrap(sock: socket.socket, authkey: bytes, timeout: float, client: bool) -> Connection:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)  # Connection does blocking I/O on the raw fd
    _handshake_timeout(sock, timeout)
    conn = Connection(sock.detach())  # the Connection owns the fd from here on
    try:
        if client:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
        else:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        view = socket.socket(fileno=conn.fileno())
        try:
            _handshake_timeout(view, 0)  # 0: no timeout once authenticated
        finally:
            view.detach()
    except BaseException:
        conn.close()
        raise
    return conn


def connect(host: str, port: int, authkey: bytes, timeout: float) -> Connection:
    """Open an authenticated connection to the head (both sides prove they hold the key)."""
    return _wrap(socket.create_connection((host, port), timeout=timeout), authkey, timeout, True)


def accept(sock: socket.socket, authkey: bytes, timeout: float) -> Connection:
    """Authenticate an accepted socket (raises AuthenticationError, OSError on timeout)."""
    return _wrap(sock, authkey, timeout, False)
