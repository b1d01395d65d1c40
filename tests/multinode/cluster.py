"""Real `vllm serve` heads and headless stage nodes for the multi-node tests.

A head runs the API server and stage 0 (AR); a node runs stage 1 (DiT) and registers with the
head. Either may run inside a network namespace (`ip netns exec`), which is how two hosts are
simulated; HTTP calls into a namespace go through `ns_client.py` run inside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from ns_http import NsHttp

REPO = Path(__file__).resolve().parents[2]
VLLM = str(Path(sys.executable).parent / "vllm")
CONFIG = "stage_configs/glm_image_tiny_nixl.yaml"
NS_CLIENT = Path(__file__).with_name("ns_client.py")


class Proc:
    """One `vllm serve` process (head or node) with its log; stop() leaves nothing behind."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str], netns: str | None = None):
        self.log = log
        cmd = [VLLM, "serve", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]  # ip execs the command: same pid
        full_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        full_env.update(env)
        self.proc = subprocess.Popen(
            cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=full_env, cwd=REPO
        )
        self.tree: list[psutil.Process] = []

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def descendants(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        # Stage processes run in their own sessions; remember them so none outlives a test.
        self.tree.extend(p for p in found if p not in self.tree)
        return found

    def pause_all(self) -> None:
        """SIGSTOP the process and everything it started (kill_all resumes them to kill)."""
        for p in [psutil.Process(self.proc.pid), *self.descendants()]:
            try:
                p.send_signal(signal.SIGSTOP)
            except psutil.NoSuchProcess:
                pass

    def resume_all(self) -> None:
        for p in [psutil.Process(self.proc.pid), *self.descendants()]:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass

    def kill_all(self) -> None:
        """SIGKILL the process and everything it started at once (a machine dying)."""
        procs = [psutil.Process(self.proc.pid), *self.descendants()]
        for p in procs:
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(30)

    def stop(self) -> None:
        self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        for p in self.tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def head_args(
    model: Path,
    http_port: int,
    master_port: int,
    host: str = "127.0.0.1",
    master_bind: str | None = None,
) -> list:
    """`master_bind`: the registry's listen address; None keeps the default (loopback). Any
    other address needs VLLM_OMNI_AUTHKEY in the head's environment."""
    bind = ["--omni-master-address", master_bind] if master_bind else []
    return [
        str(model),
        "--stage-config",
        CONFIG,
        "--stage-ids",
        "0",
        "--omni-master-port",
        str(master_port),
        *bind,
        "--host",
        host,
        "--port",
        str(http_port),
    ]


def node_args(model: Path, master: str, master_port: int) -> list:
    return [
        str(model),
        "--stage-config",
        CONFIG,
        "--headless",
        "--stage-ids",
        "1",
        "--omni-master-address",
        master,
        "--omni-master-port",
        str(master_port),
    ]


def wait_status(url: str, want: int | None, proc: Proc, timeout: float) -> float:
    """Poll `url` until it answers `want` (None: any status). Seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.proc.returncode}):\n{proc.log_tail()}")
        try:
            status = httpx.get(url, timeout=2).status_code
            if want is None or status == want:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer {want} in {timeout} s:\n{proc.log_tail()}")


def stage_metric(metrics: str, name: str, stage_id: int) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'stage_id="{stage_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} for stage {stage_id} not in /metrics")


def connector_metric(metrics: str, name: str, connector: str, role: str) -> float:
    for line in metrics.splitlines():
        if (
            line.startswith(name + "{")
            and f'connector="{connector}"' in line
            and f'role="{role}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{{connector={connector},role={role}}} not in /metrics")


def ns_call(netns: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run ns_client.py inside `netns` and return its JSON answer."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, str(NS_CLIENT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if out.returncode != 0:
        raise RuntimeError(f"ns_client failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def two_hosts(prefix: str, subnet: int) -> Iterator[dict[str, tuple[str, str, str]]]:
    """Two network namespaces joined by a veth pair: {"head": (ns, dev, addr), "node": ...}.
    Each sees only its end of the veth and its own loopback; both are deleted on exit."""
    tag = os.getpid() % 100000
    net = f"10.{subnet}.{tag % 200 + 20}"
    hosts = {
        "head": (f"omni-{prefix}{tag}-head", f"v{prefix}{tag}h", f"{net}.1"),
        "node": (f"omni-{prefix}{tag}-node", f"v{prefix}{tag}n", f"{net}.2"),
    }
    (_, dev_h, _), (_, dev_n, _) = hosts["head"], hosts["node"]
    try:
        for ns, _, _ in hosts.values():
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", dev_h, "type", "veth", "peer", "name", dev_n)
        for ns, dev, addr in hosts.values():
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns, _, _ in hosts.values():  # deleting a namespace deletes its veth end too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def ns_wait_healthy(ns: str, url: str, procs: list[Proc], timeout: float) -> None:
    """Wait until `url`/health answers 200 inside `ns` (RuntimeError if a process exits)."""
    t0 = time.monotonic()
    with NsHttp(ns) as web:
        while time.monotonic() - t0 < timeout:
            for p in procs:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.log.name} exited:\n{p.log_tail()}")
            if web.get(f"{url}/health")["status"] == 200:
                return
            time.sleep(0.5)
    raise TimeoutError("\n\n".join(p.log_tail() for p in procs))
