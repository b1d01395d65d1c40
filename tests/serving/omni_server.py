"""Start and watch real `vllm serve` processes for the serving tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from free_ports import free_port

REPO = Path(__file__).resolve().parents[2]
VLLM = str(Path(sys.executable).parent / "vllm")
API_KEY = "test-key"
OTHER_KEY = "other-key"  # a second key on servers that test what one key cannot see of another
QWEN_MAX_BATCH, QWEN_MAX_QUEUED = 2, 2  # qwen_server (conftest.py): what runs, what may wait
# A multipart body whose one file part (an image) is the zeros send_chunked streams after it.
MULTIPART_FILE_START = (
    b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
    b"Content-Type: image/png\r\n\r\n"
)
# serving.request_timeout_s of the Qwen test server; its ordinary test requests take
# 0.1-1 s on a busy box.
REQUEST_TIMEOUT_S = 5


class Server:
    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # Our routes must work without VLLM_PLUGINS; tests that need it pass it in `env`.
        full_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [VLLM, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
        )

    def wait_healthy(self, timeout: float = 300.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in self.descendants():
            p.kill()


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def send_chunked(
    url: str,
    method: str,
    path: str,
    headers: dict[str, str],
    total: int = 256 << 20,
    chunk: int = 1 << 20,
    prefix: bytes = b"",
) -> tuple[int, dict, int]:
    """Send a chunked body of `prefix` then zeros, `total` bytes in all, to `path`, stopping as
    soon as the server answers; (status, JSON body or {}, bytes sent). Raw HTTP/1.1: clients
    would send the whole body before reading an early answer."""
    import json
    import select
    from urllib.parse import urlsplit

    where = urlsplit(url)
    head = f"{method} {path} HTTP/1.1\r\nHost: {where.netloc}\r\nTransfer-Encoding: chunked\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "Connection: close\r\n\r\n"
    piece = f"{chunk:x}\r\n".encode() + bytes(chunk) + b"\r\n"
    sent = 0
    with socket.create_connection((where.hostname, where.port), timeout=60) as s:
        s.sendall(head.encode())
        if prefix:
            s.sendall(f"{len(prefix):x}\r\n".encode() + prefix + b"\r\n")
            sent += len(prefix)
        try:
            while sent < total:
                readable, _, _ = select.select([s], [], [], 0)
                if readable:
                    break
                s.sendall(piece)
                sent += chunk
            else:
                s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: read its answer
        reply = b""
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    break
                reply += data
        except (ConnectionResetError, TimeoutError):
            pass
    status_line, _, rest = reply.partition(b"\r\n")
    status = int(status_line.split()[1])
    _, _, body = rest.partition(b"\r\n\r\n")
    try:
        return status, json.loads(body), sent
    except ValueError:
        return status, {}, sent
