"""A real two-node Ray cluster on one machine, each node in its own network namespace.

Two namespaces joined by a veth pair simulate two hosts: the Ray head (and the API server, its
driver) in one, a second `ray start` in the other. Every Ray process binds and talks only on
its namespace's veth address or loopback: nothing reaches the machine's own interfaces (Ray
turns a 127.0.0.1 node address into the machine's external one, so loopback alone cannot hold
two Ray nodes). Ray's daemons detach from `ray start`; `stop()` kills every process left in the
two namespaces by pid, then deletes them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")
VLLM = str(Path(sys.executable).parent / "vllm")
NS_LOAD = Path(__file__).with_name("ns_load.py")
REPO = Path(__file__).resolve().parents[2]
RAY_PORT = 6379


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def netns_inode(ns: str) -> int:
    return os.stat(f"/run/netns/{ns}").st_ino


def pids_in(ns: str) -> list[int]:
    """Processes whose network namespace is `ns`."""
    inode, out = netns_inode(ns), []
    for p in psutil.process_iter():
        try:
            if os.stat(f"/proc/{p.pid}/ns/net").st_ino == inode:
                out.append(p.pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


class TwoNodeRay:
    def __init__(self, tmp: Path, cpus_per_node: int = 2):
        self.cpus_per_node = cpus_per_node  # logical CPUs: each replica's bundle asks 1
        tag = os.getpid() % 100000
        net = f"10.202.{tag % 200 + 20}"
        self.head_ns, self.node_ns = f"omni-r{tag}-head", f"omni-r{tag}-node"
        self.head_ip, self.node_ip = f"{net}.1", f"{net}.2"
        self.tmp = tmp
        # Ray's unix sockets live under its temp dir: keep the path short.
        self.temp_dirs = [f"/tmp/omni-ray-{tag}-h", f"/tmp/omni-ray-{tag}-n"]
        # Ray's token authentication, as the project runs it (orchestrator/ray_auth.py), with a
        # token of this cluster's own in a temporary home: nothing is read from or written to
        # the user's ~/.ray (a token left there changes what `ray start` does).
        home = tmp / "home"
        home.mkdir()
        token = tmp / "ray_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        inherited = {
            k: v
            for k, v in os.environ.items()
            if k != "VLLM_PLUGINS" and not k.startswith(("RAY_AUTH", "XDG_"))
        }
        self.env = {
            **inherited,
            "HOME": str(home),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
        }
        self.server: subprocess.Popen | None = None
        self.server_log = tmp / "server.log"

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{RAY_PORT}"

    def start(self) -> None:
        tag = self.head_ns.split("-")[1]
        dev_h, dev_n = f"v{tag}h", f"v{tag}n"  # interface names: 15 characters at most
        sh("ip", "netns", "add", self.head_ns)
        sh("ip", "netns", "add", self.node_ns)
        sh("ip", "link", "add", dev_h, "type", "veth", "peer", "name", dev_n)
        for ns, dev, ip in (
            (self.head_ns, dev_h, self.head_ip),
            (self.node_ns, dev_n, self.node_ip),
        ):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        # Logical CPUs: room for the replicas spread over the two nodes (the bundles ask 1 CPU
        # each); a small object store (requests and images are small) keeps /dev/shm free for
        # the stages.
        common = [
            "--num-cpus",
            str(self.cpus_per_node),
            "--object-store-memory",
            str(200 << 20),
            "--disable-usage-stats",
        ]
        self._ray(
            self.head_ns,
            ["start", "--head", "--node-ip-address", self.head_ip, "--port", str(RAY_PORT)]
            + ["--include-dashboard=false", "--temp-dir", self.temp_dirs[0], *common],
        )
        self._ray(
            self.node_ns,
            ["start", "--address", self.address, "--node-ip-address", self.node_ip]
            + ["--temp-dir", self.temp_dirs[1], *common],
        )

    def _ray(self, ns: str, args: list[str]) -> None:
        out = subprocess.run(
            ["ip", "netns", "exec", ns, RAY, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0:
            raise RuntimeError(f"ray {args[0]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")

    def serve(self, model: Path, config: str, port: int, *extra: str) -> None:
        """`vllm serve` in the head's namespace, a driver of this cluster (RAY_ADDRESS)."""
        cmd = [VLLM, "serve", str(model), "--stage-config", config]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *extra]
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", self.head_ns, *cmd],
            env={**self.env, "RAY_ADDRESS": self.address},
            stdout=open(self.server_log, "ab"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def server_log_size(self) -> int:
        return self.server_log.stat().st_size

    def server_log_since(self, offset: int) -> str:
        """What the server wrote after `offset` bytes (Ray's own warnings can flood a tail)."""
        with open(self.server_log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def server_tail(self, n: int = 80) -> str:
        lines = self.server_log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def call(self, *args: str, timeout: float = 300) -> object:
        """ns_load.py inside the head's namespace (the server listens on its loopback)."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.head_ns, sys.executable, str(NS_LOAD), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )
        if out.returncode != 0:
            raise RuntimeError(f"ns_load failed ({out.returncode}): {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def call_async(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["ip", "netns", "exec", self.head_ns, sys.executable, str(NS_LOAD), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def wait_healthy(self, url: str, timeout: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.server is not None
            if self.server.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.server_tail()}")
            if self.call("get", f"{url}/health")["status"] == 200:
                return
            time.sleep(1.0)
        raise TimeoutError(f"not healthy in {timeout} s:\n{self.server_tail()}")

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(60)
            except subprocess.TimeoutExpired:
                self.server.kill()
        for ns in (self.head_ns, self.node_ns):
            try:
                for pid in pids_in(ns):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            except FileNotFoundError:  # the namespace was never made
                continue
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for d in self.temp_dirs:
            shutil.rmtree(d, ignore_errors=True)


def replica_rows(metrics: str, name: str, stage: int = 0) -> dict[int, tuple[str, float]]:
    """{replica: (node, value)} of one omni_replica_* family of a stage."""
    rows = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'stage_id="{stage}"' in line:
            labels = dict(
                kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            rows[int(labels["replica"].strip('"'))] = (
                labels["node"].strip('"'),
                float(line.rsplit(" ", 1)[1]),
            )
    return rows


def replica_actor_pid(ns: str, stage: int | None = None) -> int:
    """The one stage-replica actor process inside namespace `ns` (of `stage`: the one whose
    stage process is `omni-stage-<stage>`)."""
    found = [
        pid for pid in pids_in(ns) if "StageReplicaActor" in " ".join(psutil.Process(pid).cmdline())
    ]
    if stage is not None:
        title = f"omni-stage-{stage}"
        found = [
            pid
            for pid in found
            if any(
                title in " ".join(c.cmdline()) for c in psutil.Process(pid).children(recursive=True)
            )
        ]
    assert len(found) == 1, found
    return found[0]
