"""Streamed edges on CPU, end to end through real stage processes (no model: seconds).

The test-only pipeline (stream_stages.py beside this file, deploy file stream_test.yaml): a
source stage emits float32 tensor chunks to a sink stage that reads them slower than they come
and returns their SHA-256; the edge names a shared-memory connector, which a streamed edge does
not use: its chunks go over the edge's own channel, stage to stage. The orchestrator is the one
`vllm serve` runs; one per topology, shared by the module's tests.

Checked: the consumer starts before the producer finishes (the stages' own timestamps); the
chunks arrive complete and in order (checksum equal to the one computed here, exactly); they
never pass through the API server's process (the bytes it read from the source's control
socket stay below one chunk) and no file is created per chunk; a slow consumer holds at most
the window (2) of chunks and the producer never has more out; a final stage's chunks reach
the caller as an async iterator while the source still runs; cancelling mid-stream frees both
stages, every channel and descriptor; killing either stage mid-stream fails the request (503)
within the watchdog bound, the survivor drops the request and its channel, and the stage
comes back; a stopped consumer is caught by the stall watchdog while its throttled producer
is not, and neither a long stream that keeps moving nor a consumer waiting longer than its
deadline on a slow producer is flagged.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from stream_stages import chunk_tensor, expected_checksum

from vllm_omni_plugin.common.messages import GenerationParams, Submit
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.connectors.edge_channel import (
    EdgeChunk,
    EdgeCredit,
    EdgeHello,
    decode_frame,
    encode_frame,
)
from vllm_omni_plugin.connectors.edge_channel import connect as edge_connect
from vllm_omni_plugin.orchestrator import Orchestrator, StageUnavailableError
from vllm_omni_plugin.orchestrator.streaming import OutputChunk
from vllm_omni_plugin.stages.payloads import inline

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

HERE = Path(__file__).parent
WINDOW = 2  # stream_stages' topologies
STALL_TIMEOUT_S = 3.0  # stream_test.yaml
# Death: the control socket's EOF (at once) + the exit-code wait; a stall: the deadline + the
# supervisor's 0.5 s round; both + slack for a loaded 2-core box.
FAIL_WITHIN_S = STALL_TIMEOUT_S + 2.5


def shm_files(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.startswith("omni-shm-")]


def sockets(pid: int) -> int:
    """Open socket descriptors of a process (its control socket, its listener, channels)."""
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def api_bytes(orch: Orchestrator, sid: int) -> int:
    """Bytes this (the API server's) process read from the stage's control socket so far."""
    return orch.stages[sid].proc.bytes_read


async def start(pipeline: str, shm: Path) -> Orchestrator:
    os.environ["OMNI_TEST_SHM_DIR"] = str(shm)
    os.environ["OMNI_TEST_PIPELINE"] = pipeline
    # The stage processes import stream_stages (their loops) from this folder.
    stages_path = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["OMNI_TEST_STAGES_PATH"] = os.pathsep.join(stages_path)
    try:
        cfg = load_deploy_config(HERE / "stream_test.yaml", model="/unused")
    finally:
        for name in ("OMNI_TEST_PIPELINE", "OMNI_TEST_SHM_DIR", "OMNI_TEST_STAGES_PATH"):
            del os.environ[name]
    orch = Orchestrator(cfg, startup_timeout_s=120)
    await orch.start()
    # The first Result loads /metrics' exporter (imports vLLM, seconds with the loop blocked,
    # as it never is in a server that runs vLLM already): before the timed tests.
    await orch.generate("warm-up", params(1))
    return orch


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sink_pipeline(tmp_path_factory):
    shm = tmp_path_factory.mktemp("stream-shm")
    orch = await start("stream_test", shm)
    yield orch, shm
    await orch.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chain_pipeline(tmp_path_factory):
    shm = tmp_path_factory.mktemp("chain-shm")
    orch = await start("stream_test_chain", shm)
    yield orch, shm
    await orch.aclose()


def params(chunks: int, seed: int = 3, values: int = 4096) -> GenerationParams:
    return GenerationParams("chunks", seed=seed, num_frames=chunks, width=values)


async def until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def held(orch: Orchestrator) -> list[dict]:
    return [(await s.inspect())["requests"] for s in orch.stages.values()]


async def until_streaming(orch: Orchestrator, rid: str, read: int = 2) -> None:
    """Until the sink read `read` chunks of `rid` (the stages' own counts, mid-stream)."""
    t0 = time.monotonic()
    while True:
        found = await orch.stages[1].inspect()
        if found and found["requests"].get(rid, {}).get("in_0", 0) >= read:
            return
        assert time.monotonic() - t0 < 10, f"{rid} not streaming within 10 s"
        await asyncio.sleep(0.02)


async def until_freed(orch: Orchestrator, idle_sockets: dict[int, int], timeout: float) -> None:
    """Until no stage holds any request or channel, and each is back to its idle sockets."""
    t0 = time.monotonic()
    while True:
        now = {sid: sockets(s.pid) for sid, s in orch.stages.items() if sid in idle_sockets}
        if now == idle_sockets and await held(orch) == [{}, {}]:
            return
        assert time.monotonic() - t0 < timeout, (now, idle_sockets, await held(orch))
        await asyncio.sleep(0.05)


def idle(orch: Orchestrator) -> dict[int, int]:
    return {sid: sockets(s.pid) for sid, s in orch.stages.items()}


async def test_consumer_overlaps_producer_chunks_in_order_and_bounded(sink_pipeline):
    orch, shm = sink_pipeline
    most_files = 0

    async def watch_shm() -> None:
        nonlocal most_files
        while True:
            most_files = max(most_files, len(shm_files(shm)))
            await asyncio.sleep(0.005)

    def first_outputs() -> dict[int, tuple[int, float]]:
        return {
            s["stage_id"]: (s["first_outputs"], s["first_output_seconds"])
            for s in orch.stage_stats()
        }

    before = first_outputs()
    through_api = api_bytes(orch, 0)
    watcher = asyncio.ensure_future(watch_shm())
    try:
        result = await orch.generate("r-order", params(12))
    finally:
        watcher.cancel()
    through_api = api_bytes(orch, 0) - through_api
    source, sink = result.metrics["stage_0"], result.metrics["stage_1"]
    # The source's first chunk went out early in its run (/metrics' time to first output);
    # the sink streams nothing out.
    after = first_outputs()
    assert after[0][0] - before[0][0] == 1 and after[1] == before[1], (before, after)
    assert 0 < after[0][1] - before[0][1] < source["stage_s"] / 4, (before, after, source)
    assert result.outputs[1] == [expected_checksum(3, 12, 4096).encode()]  # exact, in order
    assert source["chunks"] == sink["chunks"] == 12
    # The sink read the first chunk before the source emitted its last one.
    assert sink["first_chunk_at"] < source["last_chunk_at"], (sink, source)
    # Stage to stage: 12 chunks of 16 KiB reached the sink, but the API server read less than
    # one chunk from the source (its Result, pulses), and no chunk became a file.
    assert through_api < 4096 * 4, through_api
    assert most_files == 0, most_files
    # The slow sink (40 ms a chunk vs 5 ms) never held more than the window, and the source
    # never had more out unacknowledged: back-pressure.
    assert sink["max_waiting"] <= WINDOW and source["max_unacked"] == WINDOW, (sink, source)
    # Throttled, not buffered: the source finished only a window's reads before the sink.
    assert sink["last_chunk_at"] - source["last_chunk_at"] < (WINDOW + 1) * 0.04 + 0.3
    assert shm_files(shm) == []


async def test_a_local_edge_keeps_large_tensor_chunks_inline(sink_pipeline):
    """Chunks of 256 KiB, above stream_nixl_min_bytes: on one host they stay in the channel's
    frames (NIXL is for edges across nodes); nothing is registered or counted as NIXL."""
    from vllm_omni_plugin.connectors.stats import all_snapshots

    def nixl_puts() -> int:
        return sum(s["puts"] for s in all_snapshots() if s["name"] == "edge_0_1_nixl")

    orch, _ = sink_pipeline
    before = nixl_puts()
    result = await orch.generate("r-large", params(3, values=1 << 16))
    assert result.outputs[1] == [expected_checksum(3, 3, 1 << 16).encode()]
    assert result.metrics["stage_0"]["max_nixl_held"] == 0
    assert nixl_puts() == before


async def test_final_stage_chunks_stream_to_the_caller_in_order(chain_pipeline):
    orch, shm = chain_pipeline
    got: list[tuple[int, float]] = []
    final = None
    first_at = None
    idle_sockets = idle(orch)
    through_api = api_bytes(orch, 0)
    async for event in orch.stream("r-client", params(10, seed=5, values=256)):
        if isinstance(event, OutputChunk):
            first_at = first_at or time.time()
            if event.seq % 2 == 0:  # the relay sends bytes, then a float64 tensor, in turn
                got.append((event.seq, struct.unpack("<d", event.payload)[0]))
            else:
                assert event.payload.dtype == torch.float64 and event.payload.shape == (1,)
                got.append((event.seq, float(event.payload[0])))
        else:
            final = event
    assert [seq for seq, _ in got] == list(range(10))
    assert final is not None and final.outputs[1] == [expected_checksum(5, 10, 256).encode()]

    sums = [float(chunk_tensor(5, i, 256).double().sum()) for i in range(10)]
    assert [s for _, s in got] == sums  # exact: the same float64 sums, bytes or tensor
    assert first_at < final.metrics["stage_0"]["last_chunk_at"]  # before the source ended
    assert shm_files(shm) == []
    # The source's 10 chunks of 1 KiB went to the relay, not through this process.
    assert api_bytes(orch, 0) - through_api < 1024, api_bytes(orch, 0) - through_api

    # The caller hangs up after two chunks: both stages drop the request, every buffer goes.
    events = orch.stream("r-hangup", params(200, values=256))
    async for event in events:
        if event.seq == 1:
            break
    await events.aclose()
    await until(lambda: all(s.load == 0 for s in orch.stages.values()), 2, "stages freed")
    await until_freed(orch, idle_sockets, 2)


async def test_cancel_mid_stream_frees_both_stages_and_every_buffer(sink_pipeline):
    orch, shm = sink_pipeline
    idle_sockets = idle(orch)
    task = asyncio.ensure_future(orch.generate("r-cancel", params(200)))
    await until_streaming(orch, "r-cancel")
    assert all(sockets(s.pid) > idle_sockets[sid] for sid, s in orch.stages.items())  # a channel
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Neither stage holds the request, its channel or a descriptor of it any more.
    await until_freed(orch, idle_sockets, 2)
    assert all(s.load == 0 for s in orch.stages.values())


async def test_a_consumer_that_stops_reading_early_releases_its_producer(sink_pipeline):
    orch, _ = sink_pipeline
    idle_sockets = idle(orch)
    early = GenerationParams("chunks", seed=3, num_frames=40, width=4096, num_inference_steps=3)
    t0 = time.monotonic()
    result = await orch.generate("r-early", early)
    # The sink read 3 chunks and returned; the source was told and finished its 40 without
    # waiting for credits that would never come (40 x 5 ms, far from the stall deadline).
    assert result.outputs[1] == [expected_checksum(3, 3, 4096).encode()]
    assert (result.metrics["stage_0"]["chunks"], result.metrics["stage_1"]["chunks"]) == (40, 3)
    assert time.monotonic() - t0 < STALL_TIMEOUT_S
    await until_freed(orch, idle_sockets, 2)


@pytest.mark.parametrize("victim", [0, 1], ids=["producer", "consumer"])
async def test_a_stage_killed_mid_stream_fails_the_request_and_frees_buffers(sink_pipeline, victim):
    orch, shm = sink_pipeline
    stage = orch.stages[victim]
    survivor = 1 - victim
    idle_sockets = {survivor: sockets(orch.stages[survivor].pid)}
    task = asyncio.ensure_future(orch.generate(f"r-kill-{victim}", params(200)))
    await until_streaming(orch, f"r-kill-{victim}")
    t0 = time.monotonic()
    os.kill(stage.pid, signal.SIGKILL)
    with pytest.raises(StageUnavailableError, match=f"stage {victim} .* died"):
        await task
    assert time.monotonic() - t0 < FAIL_WITHIN_S
    # The survivor dropped the request and closed its end of the channel.
    t0 = time.monotonic()
    while (found := await orch.stages[survivor].inspect()) is None or found["requests"]:
        assert time.monotonic() - t0 < 2, found
        await asyncio.sleep(0.05)
    await until(
        lambda: sockets(orch.stages[survivor].pid) == idle_sockets[survivor], 2, "channel closed"
    )
    assert shm_files(shm) == []
    await until(lambda: stage.ready, 120, "the killed stage restarted")
    result = await orch.generate(f"r-after-{victim}", params(4))
    assert result.outputs[1] == [expected_checksum(3, 4, 4096).encode()]


async def test_watchdog_acts_per_chunk(sink_pipeline):
    orch, shm = sink_pipeline
    # A stream four times longer than the deadline that keeps moving: never flagged (the
    # throttled source waits on the sink; the sink always has a chunk to read).
    t0 = time.monotonic()
    result = await orch.generate("r-long", params(int(4 * STALL_TIMEOUT_S / 0.04)))
    assert time.monotonic() - t0 > STALL_TIMEOUT_S
    assert result.metrics["stage_1"]["chunks"] == int(4 * STALL_TIMEOUT_S / 0.04)
    stalls = [s.stats().stalls for s in orch.stages.values()]

    # A slow source (a chunk per 1.5 deadlines, working meanwhile): the sink waits longer than
    # its deadline for each chunk and is not flagged either (it says it waits on the source).
    slow = GenerationParams(
        "chunks", seed=3, num_frames=3, width=16, height=int(1500 * STALL_TIMEOUT_S)
    )
    result = await orch.generate("r-slow", slow)
    assert result.outputs[1] == [expected_checksum(3, 3, 16).encode()]
    assert [s.stats().stalls for s in orch.stages.values()] == stalls

    # A stopped sink: its chunks stop moving; it is flagged, the throttled source is not.
    sink = orch.stages[1]
    idle_source = sockets(orch.stages[0].pid)
    task = asyncio.ensure_future(orch.generate("r-stop", params(200)))
    await until_streaming(orch, "r-stop")
    os.kill(sink.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(StageUnavailableError, match="stage 1 .* made no progress"):
        await task
    assert time.monotonic() - t0 < FAIL_WITHIN_S
    assert [s.stats().stalls for s in orch.stages.values()] == [stalls[0], stalls[1] + 1]
    await until(lambda: sink.ready, 120, "the stalled stage restarted")
    await until_freed(orch, idle(orch) | {0: idle_source}, 5)


class Producer:
    """This test as a stage's producer: a plain blocking socket speaking the edge's frames."""

    def __init__(self, address: str, rid: str, token: str, window: int = WINDOW):
        self.sock = edge_connect(address)
        self.sock.setblocking(True)
        self.sock.settimeout(5)
        self.send(EdgeHello(rid, 0, 1, token, window))

    def send(self, msg) -> None:
        self.sock.sendall(encode_frame(msg))

    def chunk(self, seq: int, values: int = 4096) -> None:
        self.send(EdgeChunk(seq, inline(chunk_tensor(3, seq, values))))

    def recv(self):
        """The consumer's next message; None once it closed the channel."""
        head = self.sock.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            return None
        (size,) = struct.unpack("!I", head)
        return decode_frame(self.sock.recv(size, socket.MSG_WAITALL))

    def close(self) -> None:
        self.sock.close()


def sink_submit(orch: Orchestrator, rid: str, token: str) -> asyncio.Future:
    msg = Submit(
        rid,
        params(4),
        stream_inputs=[0],
        stream_tokens={0: token},
        stream_input_windows={0: WINDOW},
    )
    return asyncio.ensure_future(orch.stages[1].submit(msg))


async def test_the_consumer_holds_a_producer_to_the_edge_contract(sink_pipeline):
    """A producer that is this test, against the real sink stage: a channel that arrives before
    its Submit is claimed by it; credits come back per chunk consumed and the end marker
    completes the request; a wrong token is refused; a gap in the sequence and chunks past the
    window fail the request, naming what went wrong."""
    orch, _ = sink_pipeline
    address = orch.stages[1].edge_address
    idle_sockets = idle(orch)

    # Before its Submit: parked, then claimed; credits, then the end marker.
    good = Producer(address, "r-edge-ok", "a" * 32)
    good.chunk(0)
    good.chunk(1)
    t0 = time.monotonic()  # the channel and the inspection are separate sockets: no order
    while (found := (await orch.stages[1].inspect())["requests"]) != {
        "r-edge-ok": {"unclaimed_0": 1}
    }:
        assert time.monotonic() - t0 < 2, found
        await asyncio.sleep(0.02)
    task = sink_submit(orch, "r-edge-ok", "a" * 32)
    got = [await asyncio.to_thread(good.recv) for _ in range(2)]
    assert got == [EdgeCredit(0), EdgeCredit(1)], got
    good.send(EdgeChunk(2, end=True))
    result = await task
    assert result.error is None and result.output == [expected_checksum(3, 2, 4096).encode()]
    good.close()

    # A wrong token: the sink closes that channel; the request still takes the right one.
    task = sink_submit(orch, "r-edge-token", "b" * 32)
    forged = Producer(address, "r-edge-token", "c" * 32)
    assert await asyncio.to_thread(forged.recv) is None  # closed on us
    right = Producer(address, "r-edge-token", "b" * 32)
    right.send(EdgeChunk(0, end=True))
    result = await task
    assert result.error is None and result.metrics["chunks"] == 0, result
    forged.close()
    right.close()

    # A gap: chunk 2 after chunk 0.
    task = sink_submit(orch, "r-edge-gap", "d" * 32)
    gap = Producer(address, "r-edge-gap", "d" * 32)
    gap.chunk(0)
    gap.chunk(2)
    result = await task
    assert "chunk 2 from stage 0, expected 1" in (result.error or ""), result
    gap.close()

    # Past the window: the sink reads one chunk per 40 ms; 6 at once overflow its 2 (+1). The
    # window is the orchestrator's (the Submit's), not the one the producer claims.
    task = sink_submit(orch, "r-edge-flood", "e" * 32)
    flood = Producer(address, "r-edge-flood", "e" * 32, window=8)
    for seq in range(6):
        flood.chunk(seq)
    result = await task
    assert f"sent past its window of {WINDOW}" in (result.error or ""), result
    flood.close()
    await until_freed(orch, idle_sockets, 2)
