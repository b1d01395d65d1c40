"""A stage process's end of its control socket: messages.py structs in msgpack frames.

The framing is `multiprocessing.connection`'s (a 4-byte big-endian length, or -1 and an 8-byte
length past 2 GiB), so the API server's non-blocking reader and writer (orchestrator/frames.py)
speak to it unchanged; the bytes inside are msgpack of the one schema, never pickle.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from ..common.messages import (
    FromStageMessage,
    ToStageMessage,
    decode_from_stage,
    decode_to_stage,
    encode,
)


class MessageChannel:
    """Send and receive typed messages over a `Connection`. `incoming` decodes what arrives:
    `decode_to_stage` on the stage's side (the default), `decode_from_stage` on the API
    server's side during start-up."""

    def __init__(self, conn: Connection, incoming=decode_to_stage):
        self.conn = conn
        self._decode = incoming

    def send(self, msg: ToStageMessage | FromStageMessage) -> None:
        self.conn.send_bytes(encode(msg))

    def recv(self) -> ToStageMessage | FromStageMessage:
        """The next message (EOFError when the peer closed; a DecodeError for bad bytes)."""
        return self._decode(self.conn.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()


def server_channel(conn: Connection) -> MessageChannel:
    """The API server's end (it reads what a stage sends)."""
    return MessageChannel(conn, decode_from_stage)
