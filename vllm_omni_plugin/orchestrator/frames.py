"""Non-blocking encoding and decoding of `multiprocessing.connection.Connection` messages.

The API server reads its stages' control sockets on its event loop (`loop.add_reader`) instead of
one blocking reader thread per stage: a reply then costs one wake-up (the loop's) instead of two
(the reader thread's, then the loop's through `call_soon_threadsafe`), which is what a request's
latency pays per stage hop on a busy machine. The event loop must never block, so it reads what
the socket has and decodes whole frames; a frame split across reads waits for its rest.

Writes to a stage take the same care (FrameWriter): the stage may be busy or stopped and not
reading, and a blocking `send` would then stall every request the server handles.

Framing (CPython's `Connection._send_bytes`, unchanged since 3.3): a 4-byte big-endian signed
length, or -1 followed by an 8-byte length for frames over 2 GiB, then one message of the
schema (common/messages.py) in msgpack. Never pickle: a frame decodes to a known struct or
fails.
"""

from __future__ import annotations

import asyncio
import os
import struct

from ..common.messages import FromStageMessage, ToStageMessage, decode_from_stage, encode_into

READ_CHUNK = 1 << 20
# Unsent bytes a stage may fall behind by before sends to it fail (BrokenPipeError -> 503):
# far above any control traffic; reached only by a stage that stopped reading.
MAX_UNSENT_BYTES = 256 << 20


def encode_frame(msg: ToStageMessage) -> bytearray:
    """`msg` framed as `Connection.send_bytes` frames it (what the stage's channel reads),
    encoded in place behind its length."""
    frame = bytearray(4)
    encode_into(msg, frame, 4)
    size = len(frame) - 4
    if size > 0x7FFFFFFF:
        return bytearray(struct.pack("!iQ", -1, size)) + memoryview(frame)[4:]
    struct.pack_into("!i", frame, 0, size)
    return frame


class FrameWriter:
    """Writes frames to a non-blocking fd from its event loop, never blocking: what the socket
    does not take now waits here, in order, and goes out when the fd is writable."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int):
        self.loop = loop
        self.fd = fd
        self._unsent = bytearray()

    def write(self, frame: bytes) -> None:
        """Call on the loop. OSError (BrokenPipeError) when the peer is gone or not reading."""
        if self._unsent:
            if len(self._unsent) + len(frame) > MAX_UNSENT_BYTES:
                raise BrokenPipeError(f"peer not reading ({len(self._unsent)} bytes unsent)")
            self._unsent += frame
            return
        try:
            n = os.write(self.fd, frame)
        except (BlockingIOError, InterruptedError):
            n = 0
        if n < len(frame):
            self._unsent += memoryview(frame)[n:]
            self.loop.add_writer(self.fd, self._flush)

    def _flush(self) -> None:
        try:
            n = os.write(self.fd, self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the peer is gone: its EOF on the read side reports the death
            n = len(self._unsent)
        del self._unsent[:n]
        if not self._unsent:
            self.loop.remove_writer(self.fd)

    def close(self) -> None:
        """Stop writing (on the loop); unsent bytes are dropped."""
        if self._unsent:
            self._unsent.clear()
            self.loop.remove_writer(self.fd)


class FrameReader:
    def __init__(self, fd: int):
        self.fd = fd
        self._buf = bytearray()
        self.bytes_read = 0  # everything the peer sent so far (what crossed into this process)

    def read(self) -> list[FromStageMessage] | None:
        """Messages completed by what is readable now; None once the peer closed the socket.
        A frame outside the schema raises msgspec's DecodeError / ValidationError.

        Call only when the fd is readable (one `os.read`, so it never blocks)."""
        try:
            data = os.read(self.fd, READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self.bytes_read += len(data)
        self._buf += data
        return [decode_from_stage(frame) for frame in self._frames()]

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
