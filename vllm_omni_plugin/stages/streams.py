"""Streamed edges, the stage's side: a request's output as ordered chunks, read as they come.

A topology marks a stage `stream_output` (pipelines/topology.py): its edge to the next stage
streams, and so does a final stage's output towards the API server (Orchestrator.stream).
The orchestrator then submits the producer and its consumer together, and relays:

    producer --Chunk(seq, payload)--> orchestrator --Chunk--> consumer
    consumer --ChunkDone(seq)-------> orchestrator --Credit(seq)--> producer
    producer --Result---------------> orchestrator --Chunk(end=True)--> consumer

* Payloads: each chunk's payload goes through the edge's connector (inline when the edge has
  none, e.g. a final stage's chunks), and the consumer releases its buffer as it reads it.
* Back-pressure: a producer holds at most `stream_window` chunks of a request that the
  consumer has not finished with; `emit` waits for a Credit beyond that. A slow consumer
  therefore holds at most the window per request, and nothing is dropped.
* Order and completeness: chunks carry consecutive sequence numbers; a gap is an error. The
  end marker carries the count.
* Cancellation: an Abort drops the request's streams and releases every buffer it still
  holds, on either side; the orchestrator aborts both ends when either fails or dies.

A stage uses it through its loop (loop.py). An asyncio stage (AsyncStageLoop):
    await self.emit_chunk(msg, payload)              # producer: waits while the window is full
    async for payload in self.chunks(msg, src): ...  # consumer: src in msg.stream_inputs
A stepped stage (SteppedStageLoop) polls instead, between two engine steps:
    if self.streams.can_emit(rid): self.streams.emit_nowait(msg, payload)
    payloads, ended = self.streams.take_nowait(msg, src)
The Result a producer returns after its last chunk ends its stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..common.messages import Chunk, ChunkDone, Credit, Submit

if TYPE_CHECKING:
    from .payloads import StagePayloads

logger = logging.getLogger("vllm_omni_plugin.stages.streams")


class StreamingStage(Protocol):
    """What the streams use of their stage (loop.StageLoop, which imports this module): its
    id, its payload transports and its control socket."""

    stage_id: int
    payloads: StagePayloads

    def reply(self, msg: Any) -> None: ...


# Chunks of one request a producer may have out, unconsumed, when the topology does not say.
DEFAULT_STREAM_WINDOW = 4


class StreamError(RuntimeError):
    """A streamed edge broke its contract (a gap in the sequence, no such stream)."""


@dataclass
class _Output:
    to_stage: int | None
    via: str | None  # the edge's connector (None: inline)
    window: int
    next_seq: int = 0
    unacked: dict[int, Any] = field(default_factory=dict)  # seq -> what was sent (to release)
    credit: asyncio.Event | None = None
    first_at: float | None = None  # perf_counter() when its first chunk went out


@dataclass
class _Input:
    window: int
    queue: deque = field(default_factory=deque)  # Chunks not yet read, in arrival order
    next_seq: int = 0
    arrived: asyncio.Event | None = None


class StageStreams:
    """A stage process's streamed outputs and inputs, per request."""

    def __init__(self, stage: StreamingStage):
        self.stage = stage
        self.outputs: dict[str, _Output] = {}
        self.inputs: dict[tuple[str, int], _Input] = {}

    # ---- the loop's dispatch ---------------------------------------------------------------
    def open(self, msg: Submit) -> None:
        window = msg.stream_window or DEFAULT_STREAM_WINDOW
        if msg.stream_output:
            self.outputs[msg.request_id] = _Output(msg.to_stage, msg.out_connector, window)
        for src in msg.stream_inputs:
            self.inputs[(msg.request_id, src)] = _Input(window)

    def on_chunk(self, chunk: Chunk) -> None:
        inp = self.inputs.get((chunk.request_id, chunk.from_stage))
        if inp is None:  # the request is gone (aborted, failed): free the buffer at once
            self.stage.payloads.release(chunk.payload)
            return
        inp.queue.append(chunk)
        if len(inp.queue) > inp.window + 1:  # + the end marker
            logger.error(
                "request %s: %d chunks from stage %d waiting, window %d",
                chunk.request_id,
                len(inp.queue),
                chunk.from_stage,
                inp.window,
            )
        if inp.arrived is not None:
            inp.arrived.set()

    def on_credit(self, credit: Credit) -> None:
        out = self.outputs.get(credit.request_id)
        if out is None:
            return
        out.unacked.pop(credit.seq, None)  # the consumer released it already
        if out.credit is not None:
            out.credit.set()

    def finish(self, request_id: str) -> float | None:
        """The request's run ended. Chunks it emitted stay the consumer's to release; chunks
        it did not read are released here. Returns when its first chunk went out (None: it
        emitted none)."""
        out = self.outputs.pop(request_id, None)
        for key in [k for k in self.inputs if k[0] == request_id]:
            self._release_input(self.inputs.pop(key))
        return None if out is None else out.first_at

    def drop(self, request_id: str) -> None:
        """Abort: release everything the request holds, emitted or received."""
        out = self.outputs.pop(request_id, None)
        if out is not None:
            for value in out.unacked.values():
                self.stage.payloads.release(value)
            if out.credit is not None:
                out.credit.set()
        for key in [k for k in self.inputs if k[0] == request_id]:
            inp = self.inputs.pop(key)
            self._release_input(inp)
            if inp.arrived is not None:
                inp.arrived.set()

    def close(self) -> None:
        for rid in {*self.outputs, *(k[0] for k in self.inputs)}:
            self.drop(rid)

    def _release_input(self, inp: _Input) -> None:
        while inp.queue:
            self.stage.payloads.release(inp.queue.popleft().payload)

    # ---- producer ------------------------------------------------------------------------
    def can_emit(self, request_id: str) -> bool:
        """The request may emit a chunk now without waiting (a stepped engine asks first)."""
        out = self.outputs.get(request_id)
        return out is not None and len(out.unacked) < out.window

    def emit_nowait(self, msg: Submit, payload: Any) -> int:
        """Emit the request's next chunk (its sequence number); StreamError if the request
        does not stream or its window is full (check `can_emit`)."""
        out = self._output(msg.request_id)
        if len(out.unacked) >= out.window:
            raise StreamError(f"request {msg.request_id}: {out.window} chunks unconsumed")
        stage = self.stage
        value = stage.payloads.emit_chunk(
            payload, msg.request_id, stage.stage_id, out.to_stage, out.via
        )
        seq = out.next_seq
        out.next_seq += 1
        if out.first_at is None:
            out.first_at = time.perf_counter()
        out.unacked[seq] = value
        stage.reply(Chunk(msg.request_id, stage.stage_id, seq, value))
        return seq

    async def emit(self, msg: Submit, payload: Any) -> int:
        """`emit_nowait`, waiting for a Credit while the window is full (back-pressure)."""
        out = self._output(msg.request_id)
        while len(out.unacked) >= out.window:
            out.credit = out.credit or asyncio.Event()
            out.credit.clear()
            await out.credit.wait()
            out = self._output(msg.request_id)  # dropped meanwhile: StreamError
        return self.emit_nowait(msg, payload)

    def _output(self, request_id: str) -> _Output:
        out = self.outputs.get(request_id)
        if out is None:
            raise StreamError(f"request {request_id} does not stream its output (or is gone)")
        return out

    # ---- consumer ------------------------------------------------------------------------
    def take_nowait(self, msg: Submit, from_stage: int) -> tuple[list[Any], bool]:
        """(payloads that arrived, in order; whether the stream ended) without waiting, each
        released and acknowledged at once (a stepped engine that copies what it reads)."""
        inp = self._input(msg.request_id, from_stage)
        out: list[Any] = []
        while inp.queue:
            chunk = inp.queue.popleft()
            if self._check(msg, from_stage, inp, chunk):
                return out, True
            out.append(self.stage.payloads.receive(chunk.payload))
            self._done(msg, from_stage, chunk.seq)
        return out, False

    async def read(self, msg: Submit, from_stage: int) -> AsyncIterator[Any]:
        """The chunks of `from_stage`'s output, in order, until its end marker. Each chunk's
        buffer is released as it is read; the producer's credit for it goes back when the
        consumer asks for the next one (it is done with this one)."""
        rid = msg.request_id
        while True:
            inp = self._input(rid, from_stage)
            if not inp.queue:
                inp.arrived = inp.arrived or asyncio.Event()
                inp.arrived.clear()
                await inp.arrived.wait()
                continue
            chunk = inp.queue.popleft()
            if self._check(msg, from_stage, inp, chunk):
                return
            payload = self.stage.payloads.receive(chunk.payload)
            yield payload
            del payload
            self._done(msg, from_stage, chunk.seq)

    def _input(self, request_id: str, from_stage: int) -> _Input:
        inp = self.inputs.get((request_id, from_stage))
        if inp is None:
            raise StreamError(f"request {request_id} has no stream from stage {from_stage}")
        return inp

    def _check(self, msg: Submit, from_stage: int, inp: _Input, chunk: Chunk) -> bool:
        """True for the end marker; StreamError for a chunk out of order."""
        if chunk.seq != inp.next_seq:
            self.stage.payloads.release(chunk.payload)
            raise StreamError(
                f"request {msg.request_id}: chunk {chunk.seq} from stage {from_stage}, "
                f"expected {inp.next_seq}"
            )
        if chunk.end:
            return True
        inp.next_seq += 1
        return False

    def _done(self, msg: Submit, from_stage: int, seq: int) -> None:
        self.stage.reply(ChunkDone(msg.request_id, self.stage.stage_id, from_stage, seq))
