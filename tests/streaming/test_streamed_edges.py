"""Streamed edges on CPU, end to end through real stage processes (no model: seconds).

The test-only pipeline (stream_stages.py beside this file, deploy file stream_test.yaml): a source stage emits float32 tensor chunks through shared
memory to a sink stage that reads them slower than they come and returns their SHA-256. The
orchestrator is the one `vllm serve` runs; one per topology, shared by the module's tests.

Checked: the consumer starts before the producer finishes (the stages' own timestamps); the
chunks arrive complete and in order (checksum equal to the one computed here, exactly); a slow
consumer holds at most the window (2) of chunks and never more than 2 shared-memory files
exist; a final stage's chunks reach the caller as an async iterator while the source still
runs; cancelling mid-stream frees both stages and every buffer; killing either stage
mid-stream fails the request (503) within the watchdog bound, frees every buffer, and the
stage comes back; a stopped consumer is caught by the stall watchdog while its throttled
producer is not, and a long stream that keeps moving is never flagged.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import time
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from stream_stages import chunk_tensor, expected_checksum

from vllm_omni_plugin.common.messages import GenerationParams
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.orchestrator import Orchestrator, StageUnavailableError
from vllm_omni_plugin.orchestrator.streaming import OutputChunk

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

HERE = Path(__file__).parent
WINDOW = 2  # stream_stages' topologies
STALL_TIMEOUT_S = 3.0  # stream_test.yaml
# Death: the control socket's EOF (at once) + the exit-code wait; a stall: the deadline + the
# supervisor's 0.5 s round; both + slack for a loaded 2-core box.
FAIL_WITHIN_S = STALL_TIMEOUT_S + 2.5


def shm_files(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.startswith("omni-shm-")]


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
    watcher = asyncio.ensure_future(watch_shm())
    try:
        result = await orch.generate("r-order", params(12))
    finally:
        watcher.cancel()
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
    # The slow sink (40 ms a chunk vs 5 ms) never held more than the window, nor did shm.
    assert sink["max_waiting"] <= WINDOW and 1 <= most_files <= WINDOW, (sink, most_files)
    # Throttled, not buffered: the source finished only a window's reads before the sink.
    assert sink["last_chunk_at"] - source["last_chunk_at"] < (WINDOW + 1) * 0.04 + 0.3
    assert shm_files(shm) == []


async def test_final_stage_chunks_stream_to_the_caller_in_order(chain_pipeline):
    orch, shm = chain_pipeline
    got: list[tuple[int, float]] = []
    final = None
    first_at = None
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

    # The caller hangs up after two chunks: both stages drop the request, every buffer goes.
    events = orch.stream("r-hangup", params(200, values=256))
    async for event in events:
        if event.seq == 1:
            break
    await events.aclose()
    await until(lambda: all(s.load == 0 for s in orch.stages.values()), 2, "stages freed")
    assert await held(orch) == [{}, {}]
    await until(lambda: not shm_files(shm), 2, "every shm buffer released")


async def test_cancel_mid_stream_frees_both_stages_and_every_buffer(sink_pipeline):
    orch, shm = sink_pipeline
    task = asyncio.ensure_future(orch.generate("r-cancel", params(200)))
    await until(lambda: shm_files(shm), 10, "a chunk in shared memory")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: not shm_files(shm), 2, "every shm buffer released")
    assert await held(orch) == [{}, {}]  # neither stage holds the request any more
    assert all(s.load == 0 for s in orch.stages.values())


@pytest.mark.parametrize("victim", [0, 1], ids=["producer", "consumer"])
async def test_a_stage_killed_mid_stream_fails_the_request_and_frees_buffers(sink_pipeline, victim):
    orch, shm = sink_pipeline
    stage = orch.stages[victim]
    task = asyncio.ensure_future(orch.generate(f"r-kill-{victim}", params(200)))
    await until(lambda: shm_files(shm), 10, "a chunk in shared memory")
    t0 = time.monotonic()
    os.kill(stage.pid, signal.SIGKILL)
    with pytest.raises(StageUnavailableError, match=f"stage {victim} .* died"):
        await task
    assert time.monotonic() - t0 < FAIL_WITHIN_S
    await until(lambda: not shm_files(shm), 5, "every shm buffer released")
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

    # A stopped sink: its chunks stop moving; it is flagged, the throttled source is not.
    sink = orch.stages[1]
    task = asyncio.ensure_future(orch.generate("r-stop", params(200)))
    await until(lambda: shm_files(shm), 10, "a chunk in shared memory")
    os.kill(sink.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(StageUnavailableError, match="stage 1 .* made no progress"):
        await task
    assert time.monotonic() - t0 < FAIL_WITHIN_S
    assert [s.stats().stalls for s in orch.stages.values()] == [stalls[0], stalls[1] + 1]
    await until(lambda: not shm_files(shm), 5, "every shm buffer released")
    await until(lambda: sink.ready, 120, "the stalled stage restarted")
