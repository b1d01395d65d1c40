"""Streamed edges, the orchestrator's side: run a request whose stages overlap.

When a topology has a streaming stage (`StageSpec.stream_output`), `Orchestrator.generate`
and `Orchestrator.stream` run the request here: every stage gets its Submit as soon as its
non-streamed inputs are ready, so a consumer is submitted together with its producer and
starts on the first chunk.

A streamed edge between two stages carries its chunks and credits over its own channel,
stage process to stage process (stages/edge_streams.py): this process hands the producer the
consumer's address and both a fresh token for the request's edge, and carries none of the
edge's chunks. It supervises from what the stages say anyway: the Submit, the Result (the
producer's ends its stream; a failure fails the request), each stage's Pulses (a chunk sent
or consumed is progress) and StreamWait reports (a consumer waiting on its producer, a
producer waiting for credits, is not stalled).

A final streaming stage's chunks come here (`ClientRelay`): they are what the caller gets, as
`OutputChunk` events, and the Credit for one goes back once the caller took it.

If any stage fails or dies, or the caller goes away, every other stage of the request is
cancelled: each drops the request and closes its channels, releasing what it holds; a
stage whose peer died notices at once (its channel's EOF) and waits for that abort.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..common.messages import Chunk, Credit, Progress, Result, Submit, stage_params
from .connector_stats import absorb as absorb_connector_stats
from .errors import StageRequestError, StageUnavailableError
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
        # Per streamed edge between two stages: the request's token for its channel.
        self.edges: dict[tuple[int, int], str] = {}
        self.client: dict[int, ClientRelay] = {}
        self.stage_s = 0.0
        self.metrics: dict[str, Any] = {}
        # Each stage's handle for this request, fixed before any Submit: a replicated stage's
        # replica gets the request's Submit, its channels and its Credits (replicas.py).
        self.handles: dict[int, StageHandle] = {
            spec.stage_id: orch.stages[spec.stage_id].route(request_id) for spec in orch.order
        }
        topo = orch.cfg.topology
        for spec in orch.order:
            for src in spec.inputs:
                if topo.streams(src, spec.stage_id):
                    self.edges[(src, spec.stage_id)] = secrets.token_hex(16)
            if spec.stream_output and spec.stage_id in orch.final_ids:
                self.client[spec.stage_id] = ClientRelay(
                    request_id, self.handles[spec.stage_id], spec.stream_window, sink
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
                    self.handles[sid].cancel(self.request_id)
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
            if (src, sid) in self.edges:
                streamed.append(src)
            else:
                result = await asyncio.shield(self.tasks[src])
                inputs[src] = result.output
        consumers = [s.stage_id for s in orch.order if sid in s.inputs]
        to_stage = consumers[0] if consumers else None
        edge = (sid, to_stage)
        stream_to = None
        if edge in self.edges:
            stream_to = self.handles[to_stage].edge_address
            if stream_to is None:  # restarting: its Submit fails the request the same way
                raise StageUnavailableError(f"stage {to_stage} is not ready")
        msg = Submit(
            request_id=self.request_id,
            params=stage_params(spec.kind, self.params),
            inputs=inputs,
            out_connector=orch.edge_connector(sid, to_stage),
            to_stage=to_stage,
            stream_inputs=streamed,
            stream_output=spec.stream_output,
            stream_window=spec.stream_window if spec.stream_output else 0,
            stream_to=stream_to,
            stream_token=self.edges.get(edge, ""),
            stream_tokens={src: self.edges[(src, sid)] for src in streamed},
            stream_input_windows={
                src: orch.cfg.topology.stage(src).stream_window for src in streamed
            },
        )
        result = await self.handles[sid].submit(
            msg,
            on_progress=self.on_progress,
            on_stream=self._relay_for(sid) if sid in self.client else None,
        )
        if result.error is not None:
            absorb_connector_stats(result)
            if result.unavailable:
                raise StageUnavailableError(f"stage {sid}: {result.error}")
            raise StageRequestError(sid, result.error, result.error_field)
        absorb_connector_stats(result)
        self.stage_s += result.stage_s
        self.metrics[f"stage_{sid}"] = {**result.metrics, "stage_s": result.stage_s}
        return result

    def _relay_for(self, sid: int) -> Callable[[Any], None]:
        def on_stream(msg: Any) -> None:
            target = self.client.get(sid)
            if not isinstance(msg, Chunk) or target is None:
                logger.error(
                    "stage %d sent %s for %s, not a final stream", sid, msg, self.request_id
                )
                return
            target.on_chunk(msg)

        return on_stream
