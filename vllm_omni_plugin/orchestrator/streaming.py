"""Streamed edges, the orchestrator's side: run a request whose stages overlap.

When a topology has a streaming stage (`StageSpec.stream_output`), `Orchestrator.generate`
and `Orchestrator.stream` run the request here: every stage gets its Submit as soon as its
non-streamed inputs are ready, so a consumer is submitted together with its producer and
starts on the first chunk. Per streamed edge an `EdgeRelay` forwards the producer's Chunks to
the consumer in order, turns the consumer's ChunkDone into the producer's Credit, sends the
end marker after the producer's Result, and keeps each side's stall clock honest (a consumer
that read all it was given, a producer whose window is full, waits on the other stage).
A final streaming stage's chunks go to the API server (`ClientRelay`) as `OutputChunk` events.

If any stage fails or dies, or the caller goes away, every other stage of the request is
cancelled: each drops the request and releases the buffers it holds (stages/streams.py).
Back-pressure needs no queue here: a producer never has more than its window of chunks out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..common.messages import Chunk, ChunkDone, Credit, Progress, Result, Submit
from .connector_stats import absorb as absorb_connector_stats
from .errors import StageRequestError
from .handle import StageHandle

if TYPE_CHECKING:
    from ..pipelines.topology import StageSpec

logger = logging.getLogger("vllm_omni_plugin.orchestrator")


class StreamedStages(Protocol):
    """What a streamed run reads of the orchestrator that starts it (orchestrator.py), which
    imports this module: its stages, their order and the edges' connectors."""

    cfg: Any  # config.DeployConfig: the topology
    order: list[StageSpec]  # the stages, producers before their consumers
    final_ids: list[int]
    stages: dict[int, StageHandle]

    def edge_connector(self, from_stage: int, to_stage: int | None) -> str | None: ...


@dataclass(frozen=True)
class OutputChunk:
    """One chunk of the final stage's output, in order (`seq` from 0)."""

    stage_id: int
    seq: int
    payload: Any  # a tensor or bytes, as the stage emitted it


def plain_payload(payload: Any) -> Any:
    """A final stage's inline chunk as the caller uses it: bytes, or the tensor itself."""
    from ..common.payload import InlineTensor

    if isinstance(payload, InlineTensor):
        from ..stages.payloads import from_inline

        return from_inline(payload)
    return payload


class EdgeRelay:
    """One streamed edge of one request: producer -> consumer, credits back."""

    def __init__(self, request_id: str, producer: StageHandle, consumer: StageHandle, window: int):
        self.request_id = request_id
        self.producer = producer
        self.consumer = consumer
        self.window = window
        self.forwarded = 0
        self.acked = 0
        self.ended = False
        self._live = False  # the consumer's Submit went out: forward at once
        self._early: list[Chunk] = []

    def open(self) -> None:
        """Call right before the consumer's submit: what arrived meanwhile follows it."""
        if not self._early:
            self.consumer.set_waiting(self.request_id, True)  # nothing to read yet
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._live = True
        early, self._early = self._early, []
        for chunk in early:
            self.consumer.send_stream(chunk)

    def _send(self, chunk: Chunk) -> None:
        if self._live:
            self.consumer.send_stream(chunk)
        else:
            self._early.append(chunk)

    def on_chunk(self, chunk: Chunk) -> None:
        self.forwarded += 1
        self._send(chunk)
        self.consumer.set_waiting(self.request_id, False)  # it has work: its clock runs
        if self.forwarded - self.acked >= self.window:
            self.producer.set_waiting(self.request_id, True)  # throttled by the consumer

    def on_done(self, done: ChunkDone) -> None:
        self.acked += 1
        self.producer.send_stream(Credit(self.request_id, done.seq))
        self.producer.set_waiting(self.request_id, False)
        if self.acked >= self.forwarded and not self.ended:
            self.consumer.set_waiting(self.request_id, True)  # it waits on the producer

    def end(self, from_stage: int) -> None:
        self.ended = True
        self._send(Chunk(self.request_id, from_stage, self.forwarded, end=True))
        self.consumer.set_waiting(self.request_id, False)


class ClientRelay:
    """A final streaming stage's chunks towards the API server; the Credit for a chunk goes
    back once the caller took it (its consumer then asked for the next one)."""

    def __init__(self, request_id: str, producer: StageHandle, window: int, sink: Any):
        self.request_id = request_id
        self.producer = producer
        self.window = window
        self.sink = sink  # async callable(OutputChunk), or None: collect
        self.collected: list[Any] = []
        self.unconsumed = 0

    def on_chunk(self, chunk: Chunk) -> None:
        if self.sink is None:
            self.collected.append(plain_payload(chunk.payload))
            self.producer.send_stream(Credit(self.request_id, chunk.seq))
            return
        self.unconsumed += 1
        if self.unconsumed >= self.window:
            self.producer.set_waiting(self.request_id, True)
        self.sink.put_nowait((chunk, self))  # bounded by the window

    def consumed(self, seq: int) -> None:
        self.unconsumed -= 1
        self.producer.send_stream(Credit(self.request_id, seq))
        self.producer.set_waiting(self.request_id, False)


class StreamedRun:
    """One request through a topology with streamed edges (see the module docstring)."""

    def __init__(
        self,
        orch: StreamedStages,
        request_id: str,
        params: Any,
        on_progress: Callable[[Progress], None] | None,
        sink: asyncio.Queue | None,
    ):
        self.orch = orch
        self.request_id = request_id
        self.params = params
        self.on_progress = on_progress
        self.sink = sink
        self.tasks: dict[int, asyncio.Task] = {}
        self.relays: dict[tuple[int, int], EdgeRelay] = {}
        self.client: dict[int, ClientRelay] = {}
        self.stage_s = 0.0
        self.metrics: dict[str, Any] = {}
        topo = orch.cfg.topology
        for spec in orch.order:
            for src in spec.inputs:
                if topo.streams(src, spec.stage_id):
                    prod = topo.stage(src)
                    self.relays[(src, spec.stage_id)] = EdgeRelay(
                        request_id,
                        orch.stages[src],
                        orch.stages[spec.stage_id],
                        prod.stream_window,
                    )
            if spec.stream_output and spec.stage_id in orch.final_ids:
                self.client[spec.stage_id] = ClientRelay(
                    request_id, orch.stages[spec.stage_id], spec.stream_window, sink
                )

    async def run(self) -> dict[int, Any]:
        """Every stage's output (final stages: their Result's output, or their collected
        chunks when the caller did not stream them)."""
        for spec in self.orch.order:
            self.tasks[spec.stage_id] = asyncio.ensure_future(self._stage(spec))
        try:
            await asyncio.gather(*self.tasks.values())
        except BaseException:
            for sid, task in self.tasks.items():
                if task.done():  # finished: release what it emitted for the request
                    self.orch.stages[sid].cancel(self.request_id)
                task.cancel()  # a cancelled submit cancels the request in its stage
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            raise
        outputs = {sid: t.result().output for sid, t in self.tasks.items()}
        for sid, relay in self.client.items():
            if relay.sink is None:
                outputs[sid] = relay.collected
        return outputs

    async def _stage(self, spec: Any) -> Result:
        sid = spec.stage_id
        orch = self.orch
        inputs: dict[int, Any] = {}
        streamed: list[int] = []
        for src in spec.inputs:
            if (src, sid) in self.relays:
                streamed.append(src)
            else:
                result = await asyncio.shield(self.tasks[src])
                inputs[src] = result.output
        consumers = [s.stage_id for s in orch.order if sid in s.inputs]
        to_stage = consumers[0] if consumers else None
        msg = Submit(
            request_id=self.request_id,
            params=self.params,
            inputs=inputs,
            out_connector=orch.edge_connector(sid, to_stage),
            to_stage=to_stage,
            stream_inputs=streamed,
            stream_output=spec.stream_output,
            stream_window=spec.stream_window if spec.stream_output else 0,
        )
        for src in streamed:
            self.relays[(src, sid)].open()
        result = await orch.stages[sid].submit(
            msg, on_progress=self.on_progress, on_stream=self._relay_for(sid, to_stage)
        )
        if result.error is not None:
            absorb_connector_stats(result)
            raise StageRequestError(sid, result.error, result.error_field)
        relay = self.relays.get((sid, to_stage)) if to_stage is not None else None
        if relay is not None:
            relay.end(sid)  # first: the consumer waits for it
        absorb_connector_stats(result)
        self.stage_s += result.stage_s
        self.metrics[f"stage_{sid}"] = {**result.metrics, "stage_s": result.stage_s}
        return result

    def _relay_for(self, sid: int, to_stage: int | None) -> Callable[[Any], None]:
        def on_stream(msg: Any) -> None:
            if isinstance(msg, Chunk):
                relay = self.relays.get((sid, to_stage)) if to_stage is not None else None
                target = relay or self.client.get(sid)
                if target is None:
                    logger.error("stage %d sent a chunk of %s on no streamed edge", sid, msg)
                    return
                target.on_chunk(msg)
            elif isinstance(msg, ChunkDone):
                edge = self.relays.get((msg.from_stage, sid))
                if edge is not None:
                    edge.on_done(msg)

        return on_stream
