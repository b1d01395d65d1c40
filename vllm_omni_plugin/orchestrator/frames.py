"""Non-blocking decoding of `multiprocessing.connection.Connection` messages.

The API server reads its stages' control sockets on its event loop (`loop.add_reader`) instead of
one blocking reader thread per stage: a reply then costs one wake-up (the loop's) instead of two
(the reader thread's, then the loop's through `call_soon_threadsafe`), which is what a request's
latency pays per stage hop on a busy machine. The event loop must never block, so it reads what
the socket has and decodes whole frames; a frame split across reads waits for its rest.

Framing (CPython's `Connection._send_bytes`, unchanged since 3.3): a 4-byte big-endian signed
length, or -1 followed by an 8-byte length for frames over 2 GiB, then the pickled bytes.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

READ_CHUNK = 1 << 20


class FrameReader:
    def __init__(self, fd: int):
        self.fd = fd
        self._buf = bytearray()

    def read(self) -> list[Any] | None:
        """Messages completed by what is readable now; None once the peer closed the socket.

        Call only when the fd is readable (one `os.read`, so it never blocks)."""
        try:
            data = os.read(self.fd, READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self._buf += data
        return [pickle.loads(frame) for frame in self._frames()]

    def _frames(self) -> list[bytes]:
        frames = []
        buf = self._buf
        while len(buf) >= 4:
            (size,) = struct.unpack_from("!i", buf, 0)
            head = 4
            if size == -1:
                if len(buf) < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, 4)
                head = 12
            if len(buf) < head + size:
                break
            frames.append(bytes(buf[head : head + size]))
            del buf[: head + size]
        return frames
