"""A connector peer process driven over a socket pair (not stdout: NIXL/UCX write there).

Run as `python conn_peer.py FD`; optionally under `ip netns exec NS`. Each request is a tuple
(command, *args); each reply is ("ok", value) or ("err", exception type name, message).
Payloads of a given size are generated from a seed on both sides, so 64 MiB never crosses the pipe.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import payload_structs  # noqa: F401  (registers the tests' struct payloads)
import torch


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def digest(payload: Any) -> str:
    if isinstance(payload, torch.Tensor):
        data = payload.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    else:
        data = bytes(payload)
    return hashlib.sha256(data).hexdigest()


class Peer:
    def __init__(self) -> None:
        self.conn: Any = None
        self.kept: dict[str, Any] = {}

    def make(self, kind: str, name: str, options: dict) -> str:
        from vllm_omni_plugin.connectors import make_connector

        self.conn = make_connector(kind, name, **options)
        return getattr(self.conn, "agent_name", "")

    def put_pattern(self, request_id: str, nbytes: int, seed: int):
        return self.conn.put(request_id, 0, 1, pattern(nbytes, seed))

    def put_pattern_pooled(self, request_id: str, nbytes: int, seed: int):
        """Like put_pattern, but built in the connector's send pool (NixlConnector.empty)."""
        payload = self.conn.empty((nbytes,), torch.uint8)
        payload.copy_(pattern(nbytes, seed))
        return self.conn.put(request_id, 0, 1, payload)  # the lease keeps the slot alive

    def send_pool_used(self) -> int:
        return self.conn.send_pool.used_bytes()

    def put(self, request_id: str, payload: Any):
        return self.conn.put(request_id, 0, 1, payload)

    def get(self, desc, timeout: float, want: str = "digest"):
        payload = self.conn.get(desc, timeout)
        return digest(payload) if want == "digest" else payload

    def release(self, desc) -> None:
        self.conn.release(desc)

    def pending(self) -> int:
        return self.conn.pending()

    def stats(self) -> dict:
        return self.conn.stats.snapshot()

    def health(self) -> bool:
        return self.conn.health()

    def pid(self) -> int:
        return os.getpid()


def send(chan: Connection, reply: tuple) -> None:
    # Plain pickle: multiprocessing's pickler would pass tensors as shared file descriptors.
    chan.send_bytes(pickle.dumps(reply))


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    chan = Connection(sock.detach())
    peer = Peer()
    while True:
        try:
            cmd, *args = pickle.loads(chan.recv_bytes())
        except EOFError:
            return
        if cmd == "exit":
            if peer.conn is not None:
                peer.conn.close()
            send(chan, ("ok", None))
            return
        try:
            send(chan, ("ok", getattr(peer, cmd)(*args)))
        except Exception as e:
            send(chan, ("err", type(e).__name__, f"{e}\n{traceback.format_exc()}"))


if __name__ == "__main__":
    main()
