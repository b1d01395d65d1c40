"""Streamed edges across the node link, with real stage processes and no model (seconds).

Two hosts simulated with a network namespace and a veth pair: this test process is the head
(an Orchestrator with its node registry, and the source stage as its local stage process); a
real HeadlessNode (stream_node.py) in the namespace runs the relay stage, the final one, which
reads the source's chunks and streams one value per chunk to the API server
(tests/streaming/stream_stages.py, pipeline stream_test_chain). The source's chunks reach the
node over the edge's TCP channel on the veth, and the relay's go to the head over the node
link, their credits coming back the same ways.

Checked: the relay listens on the node's veth address; the chunks arrive complete and in
order (the relay's checksum, and every streamed value, equal those computed here) while the
source still runs; credits hold both windows; chunks of at least the source's
stream_nixl_min_bytes (64 KiB) cross through NIXL (UCX over TCP on the veth), bitwise equal,
smaller ones inline (the edge's counters say which), and no more than the window is ever
registered; a caller hanging up mid-stream frees both stages, NIXL registrations included; a
node killed mid-stream fails its request with 503 at once, the source drops it and what it
had registered, and serving resumes when the node registers again.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
import torch

from vllm_omni_plugin.common.messages import GenerationParams
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.orchestrator import Orchestrator, StageUnavailableError, remote
from vllm_omni_plugin.orchestrator.streaming import OutputChunk

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

HERE = Path(__file__).parent
STREAMING = HERE.parent / "streaming"
sys.path.insert(0, str(STREAMING))
from stream_stages import chunk_tensor, expected_checksum  # noqa: E402

WINDOW = 2  # stream_stages' topologies
# float32 values per chunk: 256 KiB, above the default stream_nixl_min_bytes (64 KiB); the
# tests' other chunks (4096 values, 16 KiB) stay below it.
NIXL_VALUES = 1 << 16
STALL_TIMEOUT_S = 3.0  # stream_test.yaml
# A lost node: the link's EOF at once, plus slack for a loaded 2-core box.
FAIL_WITHIN_S = 3.0


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def node_host():
    """A namespace for the node, joined to this (the head's) namespace by a veth pair."""
    tag = os.getpid() % 100000
    net = f"10.201.{tag % 200 + 20}"
    ns, dev_h, dev_n = f"omni-e{tag}-node", f"ve{tag}h", f"ve{tag}n"
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", dev_h, "type", "veth", "peer", "name", dev_n)
        sh("ip", "link", "set", dev_n, "netns", ns)
        sh("ip", "addr", "add", f"{net}.1/24", "dev", dev_h)
        sh("ip", "link", "set", dev_h, "up")
        sh("ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", dev_n)
        sh("ip", "-n", ns, "link", "set", dev_n, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns, f"{net}.1", f"{net}.2", dev_h, dev_n
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", dev_h], capture_output=True)


class Node:
    """stream_node.py inside the namespace; `kill` SIGKILLs it with its stage (a dead host)."""

    def __init__(self, ns: str, head: str, port: int, env: dict[str, str], log: Path):
        self.args = ["ip", "netns", "exec", ns, sys.executable, str(HERE / "stream_node.py")]
        self.args += [head, str(port), "1"]
        self.env, self.log = env, log
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT
        )

    def tree(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        for p in self.tree():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        assert self.proc is not None
        self.proc.wait(30)

    def stop(self) -> None:
        assert self.proc is not None
        procs = self.tree()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


async def until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(node_host, tmp_path_factory):
    ns, head_ip, node_ip, dev_h, dev_n = node_host
    logs = tmp_path_factory.mktemp("stream-nodes")
    env = {
        # NIXL's UCX over TCP on each side's end of the veth, as between two hosts without
        # RDMA (on one kernel UCX would otherwise find a same-host shortcut).
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": dev_h,
        "OMNI_TEST_PIPELINE": "stream_test_chain",
        "OMNI_TEST_SHM_DIR": str(tmp_path_factory.mktemp("stream-shm")),
        "OMNI_TEST_STAGES_PATH": os.pathsep.join(
            [str(STREAMING), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "VLLM_OMNI_AUTHKEY": secrets.token_hex(16),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    head = node = orch = None
    try:
        cfg = load_deploy_config(STREAMING / "stream_test.yaml", model="/unused")
        head = remote.StageHead(env["VLLM_OMNI_AUTHKEY"].encode(), 0, head_ip)
        head.local_ids = [0]
        orch = Orchestrator(cfg, startup_timeout_s=120, stage_factory=head.stage_factory(120))
        await head.start()
        await orch.start()
        node_env = {**os.environ, "UCX_NET_DEVICES": dev_n}
        node = Node(ns, head_ip, head.port, node_env, logs / "node.log")
        await until(lambda: orch.stages[1].ready, 120, "the node registers")
        await orch.generate("warm-up", params(1))  # loads /metrics' exporter (see streaming)
        yield orch, node, node_ip, logs
    finally:
        if node is not None:
            node.stop()
        if orch is not None:
            await orch.aclose()
        if head is not None:
            head.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def params(chunks: int, seed: int = 3, values: int = 4096, delay_ms: int | None = None):
    return GenerationParams("chunks", seed=seed, num_frames=chunks, width=values, height=delay_ms)


def chunk_sum(seed: int, index: int, values: int) -> float:
    return float(chunk_tensor(seed, index, values).double().sum())


def streamed_value(payload) -> float:
    if isinstance(payload, bytes):
        return struct.unpack("<d", payload)[0]
    assert isinstance(payload, torch.Tensor) and payload.shape == (1,)
    return float(payload[0])


async def test_the_relay_listens_on_the_node_address(cluster):
    orch, _, node_ip, _ = cluster
    address = orch.stages[1].edge_address
    assert address is not None and address.startswith(f"tcp:{node_ip}:"), address


async def test_chunks_cross_to_the_node_in_order_and_stream_back(cluster):
    orch, _, _, _ = cluster
    seed, chunks, values = 11, 12, 4096
    events = [e async for e in orch.stream("across", params(chunks, seed, values))]
    *streamed, result = events
    assert all(isinstance(e, OutputChunk) for e in streamed)
    assert [e.seq for e in streamed] == list(range(chunks))
    for i, event in enumerate(streamed):
        assert streamed_value(event.payload) == pytest.approx(chunk_sum(seed, i, values), abs=1e-9)
    relay = result.metrics["stage_1"]
    source = result.metrics["stage_0"]
    assert result.outputs[1] == [expected_checksum(seed, chunks, values).encode()]
    assert relay["chunks"] == chunks
    # Overlap: the relay read its first chunk before the source emitted its last.
    assert relay["first_chunk_at"] < source["last_chunk_at"]
    assert source["max_unacked"] <= WINDOW and relay["max_waiting"] <= WINDOW + 1


def edge_counters() -> dict[str, tuple[int, int, int]]:
    """The 0 -> 1 edge's counters as /metrics has them, per path: (chunks sent, their bytes,
    NIXL READs done by the consumer)."""
    from vllm_omni_plugin.connectors.stats import all_snapshots

    snaps = {s["name"]: s for s in all_snapshots()}
    out = {}
    for path in ("nixl", "inline"):
        snap = snaps.get(f"edge_0_1_{path}")
        out[path] = (
            (0, 0, 0)
            if snap is None
            else (snap["puts"], snap["put_bytes"], snap["roles"]["consumer"]["transfers"])
        )
    return out


async def test_large_tensor_chunks_go_through_nixl_small_ones_inline(cluster):
    orch, _, _, _ = cluster
    seed, chunks = 21, 6
    before = edge_counters()
    *streamed, result = [e async for e in orch.stream("nixl", params(chunks, seed, NIXL_VALUES))]
    # Bitwise: the relay's SHA-256 over the chunks' bytes, in order.
    assert result.outputs[1] == [expected_checksum(seed, chunks, NIXL_VALUES).encode()]
    assert [e.seq for e in streamed] == list(range(chunks))
    source = result.metrics["stage_0"]
    assert 1 <= source["max_nixl_held"] <= WINDOW
    after = edge_counters()
    nbytes = chunks * NIXL_VALUES * 4
    assert after["nixl"] == tuple(
        a + b for a, b in zip(before["nixl"], (chunks, nbytes, chunks), strict=True)
    )
    assert after["inline"] == before["inline"]

    *_, small = [e async for e in orch.stream("inline", params(3, seed, 4096))]
    assert small.outputs[1] == [expected_checksum(seed, 3, 4096).encode()]
    assert small.metrics["stage_0"]["max_nixl_held"] == 0
    final = edge_counters()
    assert final["nixl"] == after["nixl"]
    assert final["inline"][:2] == (after["inline"][0] + 3, after["inline"][1] + 3 * 4096 * 4)


async def test_checksum_of_the_chunks_equals_the_source(cluster):
    orch, _, _, _ = cluster
    seed, chunks, values = 5, 9, 1000
    result = await orch.generate("checksum", params(chunks, seed, values))
    values_out = [streamed_value(p) for p in result.outputs[1]]
    expected = [chunk_sum(seed, i, values) for i in range(chunks)]
    assert values_out == pytest.approx(expected, abs=1e-9)
    assert result.metrics["stage_1"]["chunks"] == chunks


async def test_a_caller_slower_than_the_watchdog_is_no_stall(cluster):
    """The caller holds the relay's window for longer than stage 1's stall_timeout_s: the
    node's own watchdog, told over the link, leaves the relay alone, as the head's does."""
    orch, _, _, _ = cluster
    relay = orch.stages[1]
    restarts, stalls = relay.status.restarts, relay.stalls
    events = []
    async for event in orch.stream("slow-caller", params(6, values=64)):
        events.append(event)
        if len(events) == 1:
            await asyncio.sleep(STALL_TIMEOUT_S + 2)
    assert [e.seq for e in events[:-1]] == list(range(6))
    assert relay.status.restarts == restarts and relay.stalls == stalls


async def test_a_caller_hanging_up_frees_both_stages(cluster):
    """Its chunks go through NIXL: the source holds registrations when the caller leaves,
    and none after."""
    orch, _, _, _ = cluster
    source, relay = orch.stages[0], orch.stages[1]

    async def held() -> dict:
        return (await source.inspect())["requests"]

    stream = orch.stream("hang-up", params(40, values=NIXL_VALUES, delay_ms=50))
    async for event in stream:
        if isinstance(event, OutputChunk) and event.seq == 2:
            break
    t0 = time.monotonic()  # the caller stopped: the relay's window, then the source's, fill
    while (await held()).get("hang-up", {}).get("nixl_held", 0) < 1:
        assert time.monotonic() - t0 < 5, await held()
        await asyncio.sleep(0.05)
    await stream.aclose()

    t0 = time.monotonic()
    while "hang-up" in (await held()) or relay.owns("hang-up"):
        assert time.monotonic() - t0 < 5, await held()
        await asyncio.sleep(0.05)
    result = await orch.generate("after-hang-up", params(3))
    assert len(result.outputs[1]) == 3


async def test_a_node_killed_mid_stream_fails_with_503_and_serving_resumes(cluster):
    orch, node, _, _ = cluster
    source, relay = orch.stages[0], orch.stages[1]
    stream = orch.stream("killed", params(200, values=NIXL_VALUES, delay_ms=50))
    async for event in stream:
        if isinstance(event, OutputChunk) and event.seq == 2:
            break
    t0 = time.monotonic()
    node.kill()
    with pytest.raises(StageUnavailableError):
        async for _ in stream:
            pass
    assert time.monotonic() - t0 < FAIL_WITHIN_S
    # The source dropped the request, its channel and its NIXL registrations.
    t1 = time.monotonic()
    while "killed" in (await source.inspect())["requests"]:
        assert time.monotonic() - t1 < 5
        await asyncio.sleep(0.05)
    assert not relay.ready
    with pytest.raises(StageUnavailableError):
        await orch.generate("no-node", params(2))
    node.start()
    await until(lambda: relay.ready, 120, "the node registers again")
    result = await orch.generate("resumed", params(4, seed=9, values=256))
    expected = [chunk_sum(9, i, 256) for i in range(4)]
    assert [streamed_value(p) for p in result.outputs[1]] == pytest.approx(expected, abs=1e-9)


async def test_a_chunk_the_node_cannot_read_fails_its_request_with_503(cluster):
    """The node's NIXL reaches no network the head's agent is on (UCX on its loopback only):
    the relay's READ of a large chunk fails, and the request fails as unavailable (503) at
    once, with nothing left registered at the source; inline chunks still flow."""
    orch, node, _, _ = cluster
    source, relay = orch.stages[0], orch.stages[1]
    node.kill()
    await until(lambda: not relay.ready, 10, "the head sees the node gone")
    node.env = {**node.env, "UCX_NET_DEVICES": "lo"}
    node.start()
    await until(lambda: relay.ready, 120, "the node registers again")
    t0 = time.monotonic()
    with pytest.raises(StageUnavailableError, match="NIXL read of chunk 0"):
        await orch.generate("unreadable", params(4, values=NIXL_VALUES))
    assert time.monotonic() - t0 < FAIL_WITHIN_S
    t1 = time.monotonic()
    while "unreadable" in (await source.inspect())["requests"]:
        assert time.monotonic() - t1 < 5
        await asyncio.sleep(0.05)
    result = await orch.generate("inline-still", params(3, seed=4, values=256))
    expected = [chunk_sum(4, i, 256) for i in range(3)]
    assert [streamed_value(p) for p in result.outputs[1]] == pytest.approx(expected, abs=1e-9)
