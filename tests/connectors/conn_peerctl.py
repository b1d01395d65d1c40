"""Start and drive a `conn_peer.py` process from a test (optionally inside a network namespace)."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

PEER = Path(__file__).with_name("conn_peer.py")
REPO = Path(__file__).resolve().parents[2]


class PeerError(RuntimeError):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class PeerProcess:
    def __init__(self, env: dict[str, str] | None = None, netns: str | None = None):
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, str(PEER), str(theirs.fileno())]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(
            cmd, pass_fds=(theirs.fileno(),), env=full_env, stdout=subprocess.DEVNULL
        )
        theirs.close()
        self.chan = Connection(ours.detach())

    @property
    def pid(self) -> int:
        # Under `ip netns exec` the python process replaces ip (exec), so the pid is the same.
        return self.proc.pid

    def call(self, cmd: str, *args: Any, timeout: float = 120) -> Any:
        self.chan.send_bytes(pickle.dumps((cmd, *args)))
        if not self.chan.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout} s")
        reply = pickle.loads(self.chan.recv_bytes())
        if reply[0] == "err":
            raise PeerError(reply[1], reply[2])
        return reply[1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process must die too
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
            except Exception:
                pass
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self.kill()
        self.chan.close()
