"""Test-only stages and topologies for streamed edges (no model, no vLLM engine: milliseconds).

    stream_test        source (0) ==chunks==> sink (1, final): the sink returns a checksum
    stream_test_chain  source (0) ==chunks==> relay (1, final) ==chunks==> the API server

The source emits `num_frames` float32 tensor chunks of `width` values each (the request's
GenerationParams, reused for the test), chunk i filled from `seed` and i, waiting
OMNI_TEST_EMIT_DELAY_MS (or the request's `height`, in ms) between chunks, pulsing meanwhile; the sink reads them, waiting OMNI_TEST_READ_DELAY_MS
per chunk (a slow consumer), and returns the SHA-256 of the chunks' bytes in order. Both are
small subclasses of stages.loop.AsyncStageLoop: the shape a new kind of stage takes. Each Result
carries wall-clock timestamps (`first_chunk_at`, `last_chunk_at`), the most chunks the
sink ever had waiting (`max_waiting`), the most the source ever had out unacknowledged
(`max_unacked`) and registered with NIXL (`max_nixl_held`, an edge across nodes), so tests
can check overlap and the bounds.

Importing this module registers both topologies (their stages are "diffusion" to the config
loader, which only sets their devices, env and watchdog: the deploy file stream_test.yaml).
The stages name their loops as a third-party pipeline would ("module:Class"), so a stage
process finds them through PYTHONPATH. `expected_checksum` computes what the sink must return.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import time

import torch

from vllm_omni_plugin.common.messages import Result, RunnerSettings, StageInfo, Submit
from vllm_omni_plugin.pipelines.registry import register_pipeline
from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec
from vllm_omni_plugin.stages.loop import AsyncStageLoop, RequestRefused

EMIT_DELAY_ENV = "OMNI_TEST_EMIT_DELAY_MS"
READ_DELAY_ENV = "OMNI_TEST_READ_DELAY_MS"
DEFAULT_CHUNKS = 8
DEFAULT_VALUES = 1024


def _delay(env: str) -> float:
    return float(os.environ.get(env, "0")) / 1000.0


def chunk_tensor(seed: int, index: int, values: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100_003 + index)
    return torch.randn(values, generator=gen, dtype=torch.float32)


def expected_checksum(seed: int, chunks: int, values: int) -> str:
    digest = hashlib.sha256()
    for i in range(chunks):
        digest.update(chunk_tensor(seed, i, values).numpy().tobytes())
    return digest.hexdigest()


class SourceStage(AsyncStageLoop):
    """Emits the request's chunks, one every OMNI_TEST_EMIT_DELAY_MS."""

    def info(self) -> StageInfo:
        return StageInfo(self.kind, RunnerSettings(self.init.spec.runner or ""))

    async def run_request(self, msg: Submit) -> Result:
        p = msg.params
        chunks, values = p.num_frames or DEFAULT_CHUNKS, p.width or DEFAULT_VALUES
        if chunks < 1:
            raise RequestRefused("num_frames must be at least 1", "num_frames")
        # `height`, when set: this request's delay in ms (a slow producer, still working).
        delay = p.height / 1000.0 if p.height else _delay(EMIT_DELAY_ENV)
        first = last = 0.0
        most = most_held = 0
        for i in range(chunks):
            await self.emit_chunk(msg, chunk_tensor(p.seed or 0, i, values))
            out = self.streams.outputs[msg.request_id]
            most = max(most, len(out.unacked))
            most_held = max(most_held, out.held() if hasattr(out, "held") else 0)
            last = time.time()
            first = first or last
            self.pulse()
            if delay and i + 1 < chunks:
                await self._work(delay)
        return Result(
            msg.request_id,
            metrics={
                "chunks": chunks,
                "first_chunk_at": first,
                "last_chunk_at": last,
                "max_unacked": most,
                "max_nixl_held": most_held,
            },
        )

    async def _work(self, seconds: float) -> None:
        """Wait `seconds` as an engine busy on the next chunk would: pulsing as it goes."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.1))
            self.pulse()


class SinkStage(AsyncStageLoop):
    """Reads the chunks slowly and returns their checksum; with `stream_output` it also
    emits, per chunk read, that chunk's float64 sum towards the API server: as 8 little-endian
    bytes for even chunks, as a one-value tensor for odd ones (both inline kinds)."""

    def info(self) -> StageInfo:
        return StageInfo(self.kind, RunnerSettings(self.init.spec.runner or ""))

    async def run_request(self, msg: Submit) -> Result:
        (src,) = msg.stream_inputs
        delay = _delay(READ_DELAY_ENV)
        digest = hashlib.sha256()
        count, first, most = 0, 0.0, 0
        # `num_inference_steps`, when set: read that many chunks, then return (the rest of
        # the source's output goes nowhere).
        stop_after = msg.params.num_inference_steps
        async for tensor in self.chunks(msg, src):
            first = first or time.time()
            most = max(most, len(self.streams.inputs[(msg.request_id, src)].queue) + 1)
            digest.update(tensor.numpy().tobytes())
            count += 1
            if msg.stream_output:
                total = tensor.double().sum()
                # Both inline kinds a final stage may send: a tensor, raw bytes (e.g. pcm16).
                piece = struct.pack("<d", float(total)) if count % 2 else total.reshape(1)
                await self.emit_chunk(msg, piece)
            self.pulse()
            if count == stop_after:
                break
            if delay:
                await asyncio.sleep(delay)
        return Result(
            msg.request_id,
            output=[digest.hexdigest().encode()],
            metrics={
                "chunks": count,
                "first_chunk_at": first,
                "last_chunk_at": time.time(),
                "max_waiting": most,
            },
        )


# A loop outside the package is named "module:Class"; the stage process imports this module
# from its PYTHONPATH, which the tests extend with this folder (test_streamed_edges.py).
_RUNNERS = "stream_stages"


def _topology(key: str, chain: bool) -> PipelineTopology:
    source = StageSpec(
        stage_id=0,
        name="source",
        kind="diffusion",
        emits="tensor_chunks",
        stream_output=True,
        stream_window=2,
        runner=f"{_RUNNERS}:SourceStage",
    )
    sink = StageSpec(
        stage_id=1,
        name="relay" if chain else "sink",
        kind="diffusion",
        inputs=[0],
        emits="tensor_chunks" if chain else "checksum",
        final_output=True,
        stream_output=chain,
        stream_window=2,
        runner=f"{_RUNNERS}:SinkStage",
    )
    return PipelineTopology(
        key=key,
        stages=(source, sink),
        description="test-only: streamed edges between two model-free stages",
    )


STREAM_TEST = _topology("stream_test", chain=False)
STREAM_TEST_CHAIN = _topology("stream_test_chain", chain=True)
for _topo in (STREAM_TEST, STREAM_TEST_CHAIN):
    register_pipeline(_topo, replace=True)
