"""Streamed edges, the stage's side: a request's output as ordered chunks, read as they come.

A topology marks a stage `stream_output` (pipelines/topology.py): its edge to the next stage
streams, and so does a final stage's output towards the API server (Orchestrator.stream).
The orchestrator then submits the producer and its consumer together:

* Between two stages the chunks and credits go straight from one stage process to the other,
  over a channel the two open for the request's edge (edge_streams.py; the wire is
  connectors/edge_channel.py). The API server carries none of them.
* A final stage's chunks go to the API server, which hands each to its caller and sends the
  Credit back once the caller took it:

    final stage --Chunk(seq, payload)--> API server --Credit(seq)--> final stage
    final stage --Result---------------> API server                 (ends the stream)

* Back-pressure: a producer holds at most `stream_window` chunks of a request that its
  consumer has not finished with; `emit` waits for a Credit beyond that. A slow consumer
  therefore holds at most the window per request, and nothing is dropped.
* Order and completeness: chunks carry consecutive sequence numbers; a gap is an error. The
  end marker carries the count.
* Cancellation: an Abort drops the request's streams and every buffer and channel it holds,
  on either side; the orchestrator aborts both ends when either fails or dies.

A stage uses it through its loop (loop.py), which must be an asyncio stage (AsyncStageLoop):
    await self.emit_chunk(msg, payload)              # producer: waits while the window is full
    async for payload in self.chunks(msg, src): ...  # consumer: src in msg.stream_inputs
The Result a producer returns after its last chunk ends its stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..common.messages import Chunk, Credit, Submit
from .edge_streams import DirectInput, DirectOutput, EdgeHub, StreamError, StreamUnavailable
from .payloads import inline

logger = logging.getLogger("vllm_omni_plugin.stages.streams")


class StreamingStage(Protocol):
    """What the streams use of their stage (loop.StageLoop, which imports this module): its
    id, its control socket and its pulse (edge_streams.py uses the same)."""

    stage_id: int

    def reply(self, msg: Any) -> None: ...

    def pulse(self) -> None: ...


# Chunks of one request a producer may have out, unconsumed, when the topology does not say.
DEFAULT_STREAM_WINDOW = 4

__all__ = ["DEFAULT_STREAM_WINDOW", "StageStreams", "StreamError", "StreamUnavailable"]


@dataclass
class _ToServer:
    """A final stage's output, chunk by chunk to the API server."""

    window: int
    next_seq: int = 0
    unacked: set[int] = field(default_factory=set)
    credit: asyncio.Event | None = None
    first_at: float | None = None  # perf_counter() when its first chunk went out


class StageStreams:
    """A stage process's streamed outputs and inputs, per request. `hub` (an asyncio stage's
    listener and stage-to-stage channels) is None in a stage that streams to no other stage."""

    def __init__(self, stage: StreamingStage):
        self.stage = stage
        self.hub: EdgeHub | None = None
        self.outputs: dict[str, _ToServer | DirectOutput] = {}
        self.inputs: dict[tuple[str, int], DirectInput] = {}

    @property
    def address(self) -> str | None:
        """Where this stage's producers connect (None: it takes no streamed inputs)."""
        return None if self.hub is None else self.hub.address

    @property
    def tcp_address(self) -> str | None:
        """Where producers on other nodes connect (None: none can)."""
        return None if self.hub is None else self.hub.tcp_address

    # ---- the loop's dispatch ---------------------------------------------------------------
    def open(self, msg: Submit) -> None:
        window = msg.stream_window or DEFAULT_STREAM_WINDOW
        rid = msg.request_id
        if msg.stream_inputs or msg.stream_to:
            if self.hub is None:
                raise StreamError(f"stage {self.stage.stage_id} serves no stage-to-stage edges")
        if msg.stream_output:
            if msg.stream_to is not None:
                assert self.hub is not None
                self.outputs[rid] = DirectOutput(self.hub, msg, self.stage.stage_id, window)
            else:
                self.outputs[rid] = _ToServer(window)
        for src in msg.stream_inputs:
            assert self.hub is not None
            token = msg.stream_tokens.get(src, "")
            in_window = msg.stream_input_windows.get(src) or DEFAULT_STREAM_WINDOW
            self.inputs[(rid, src)] = self.hub.claim(rid, src, in_window, token)

    def on_credit(self, credit: Credit) -> None:
        """The API server's Credit for a final stage's chunk."""
        out = self.outputs.get(credit.request_id)
        if not isinstance(out, _ToServer):
            return
        out.unacked.discard(credit.seq)
        if out.credit is not None:
            out.credit.set()

    def finish(self, request_id: str, ended: bool = True) -> float | None:
        """The request's run ended: its output stream ends (the end marker to a stage; when
        the run failed, `ended` False, the channel just closes), its unread inputs are
        dropped. Returns when its first chunk went out (None: none did)."""
        out = self.outputs.pop(request_id, None)
        if isinstance(out, DirectOutput):
            if ended:
                out.finish()
            else:
                out.drop()
        for key in [k for k in self.inputs if k[0] == request_id]:
            inp = self.inputs.pop(key)
            if ended:
                inp.finish()  # its producer may finish too, emitting into nothing
            else:
                inp.close()  # its producer waits for the abort that follows our error
        return None if out is None else out.first_at

    def drop(self, request_id: str) -> None:
        """Abort: close the request's channels and drop everything it holds, both ways."""
        out = self.outputs.pop(request_id, None)
        if isinstance(out, DirectOutput):
            out.drop()
        elif out is not None and out.credit is not None:
            out.credit.set()
        for key in [k for k in self.inputs if k[0] == request_id]:
            self.inputs.pop(key).close()
        if self.hub is not None:
            self.hub.drop(request_id)

    def close(self) -> None:
        for rid in {*self.outputs, *(k[0] for k in self.inputs)}:
            self.drop(rid)
        if self.hub is not None:
            self.hub.close()

    def requests(self) -> set[str]:
        """The requests with a stream or a channel here."""
        rids = {*self.outputs, *(k[0] for k in self.inputs)}
        if self.hub is not None:
            rids.update(k[0] for k in self.hub.unclaimed)
            rids.update(self.hub.nixl_held())
        return rids

    def facts(self, request_id: str) -> dict[str, int]:
        """For Inspection: chunks emitted, read per input (`in_<stage>`), and output chunks
        registered with NIXL (`nixl_held`)."""
        out = self.outputs.get(request_id)
        facts = {} if out is None else {"out": out.next_seq}
        for (rid, src), inp in self.inputs.items():
            if rid == request_id:
                facts[f"in_{src}"] = inp.read_count
        if self.hub is not None:
            for rid, src in self.hub.unclaimed:
                if rid == request_id:
                    facts[f"unclaimed_{src}"] = 1
            held = self.hub.nixl_held().get(request_id)
            if held:
                facts["nixl_held"] = held  # output chunks registered with NIXL
        return facts

    # ---- producer ------------------------------------------------------------------------
    def can_emit(self, request_id: str) -> bool:
        """The request may emit a chunk now without waiting."""
        out = self.outputs.get(request_id)
        if isinstance(out, DirectOutput):
            return out.can_emit()
        return out is not None and len(out.unacked) < out.window

    def emit_nowait(self, msg: Submit, payload: Any) -> int:
        """A final stage's next chunk to the API server (its sequence number); StreamError if
        the request does not stream there or its window is full (check `can_emit`)."""
        out = self._output(msg.request_id)
        if not isinstance(out, _ToServer):
            raise StreamError(f"request {msg.request_id} streams to a stage: await emit")
        if len(out.unacked) >= out.window:
            raise StreamError(f"request {msg.request_id}: {out.window} chunks unconsumed")
        stage = self.stage
        value = inline(payload)
        seq = out.next_seq
        out.next_seq += 1
        if out.first_at is None:
            out.first_at = time.perf_counter()
        out.unacked.add(seq)
        stage.reply(Chunk(msg.request_id, stage.stage_id, seq, value))
        return seq

    async def emit(self, msg: Submit, payload: Any) -> int:
        """The request's next chunk (its sequence number), waiting for a Credit while the
        window is full (back-pressure)."""
        out = self._output(msg.request_id)
        if isinstance(out, DirectOutput):
            return await out.emit(payload)
        while len(out.unacked) >= out.window:
            out.credit = out.credit or asyncio.Event()
            out.credit.clear()
            await out.credit.wait()
            out = self._output(msg.request_id)  # dropped meanwhile: StreamError
        return self.emit_nowait(msg, payload)

    def _output(self, request_id: str) -> _ToServer | DirectOutput:
        out = self.outputs.get(request_id)
        if out is None:
            raise StreamError(f"request {request_id} does not stream its output (or is gone)")
        return out

    # ---- consumer ------------------------------------------------------------------------
    def read(self, msg: Submit, from_stage: int) -> AsyncIterator[Any]:
        """The chunks of `from_stage`'s output, in order, until its end marker; the producer
        may send the next one once the consumer asks for it (it is done with this one)."""
        inp = self.inputs.get((msg.request_id, from_stage))
        if inp is None:
            raise StreamError(f"request {msg.request_id} has no stream from stage {from_stage}")
        return inp.read()
