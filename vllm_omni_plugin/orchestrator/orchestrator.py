"""The stage graph at run time: start every stage, route each request along the frozen topology.

A request visits the stages in topological order. Each stage gets the validated request's
parameters plus its upstream stages' outputs (connector descriptors), and returns its own
output; the final stage returns encoded images. Cancelling `generate` (client disconnect)
aborts the request in the stage that holds it. A request that fails or is cancelled after a
stage produced its payload also aborts it in that producer, which releases the payload at once
(shared-memory file, NIXL slot) instead of holding it until its lease expires.

Streamed edges (a topology stage with `stream_output`, see streaming.py and stages/streams.py)
overlap the stages: the consumer starts on the producer's first chunk, which goes to it
straight from the producer's process, not through this one. The final stage's
chunks reach the caller as they come through `stream`:

    async for event in orchestrator.stream(request_id, params):
        if isinstance(event, OutputChunk):    # in order: event.seq 0, 1, ...
            send(event.payload)               # a tensor or bytes, as the stage emitted it
        else:                                 # the last event: the PipelineResult
            finish(event)

Leaving the loop early (the client hung up) cancels the request in every stage, which frees
every buffer it holds. Taking the next event is what lets the final stage emit more: a slow
client holds the stage to its `stream_window` of chunks. `generate` runs the same request and
collects the final stage's chunks into `PipelineResult.outputs`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ..common.limits import RequestLimits
from ..common.messages import Progress, StageInfo, Submit, stage_params
from ..config.stage_init import StageInit
from .connector_stats import absorb as absorb_connector_stats
from .errors import StageRequestError
from .handle import StageHandle
from .stage_client import StageClient
from .streaming import OutputChunk, StreamedRun, plain_payload

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

DEFAULT_STARTUP_TIMEOUT_S = 600.0
# Overrides DEFAULT_STARTUP_TIMEOUT_S for the API server and for headless nodes alike.
STARTUP_TIMEOUT_ENV = "VLLM_OMNI_STAGE_STARTUP_TIMEOUT_S"


@dataclass
class PipelineResult:
    images: list[bytes]
    stage_s: float  # sum of the stages' own times for this request
    total_s: float  # orchestrator time, submit of the first stage to reply of the last
    metrics: dict[str, Any]
    # Every final stage's output (a streaming one: its chunks' payloads, in order, when they
    # were not streamed to the caller).
    outputs: dict[int, Any] = field(default_factory=dict)


def topo_order(specs: list[Any]) -> list[Any]:
    """Stages sorted so every stage comes after its inputs (the topology is validated acyclic)."""
    done: set[int] = set()
    order: list[Any] = []
    pending = list(specs)
    while pending:
        ready = [s for s in pending if set(s.inputs) <= done]
        if not ready:
            raise ValueError("pipeline topology has a cycle")
        for s in ready:
            order.append(s)
            done.add(s.stage_id)
            pending.remove(s)
    return order


class Orchestrator:
    def __init__(
        self,
        cfg: Any,
        *,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        stage_factory: Callable[[StageInit], StageHandle] | None = None,  # remote.py, Ray
    ):
        self.cfg = cfg
        self.order = topo_order(list(cfg.topology.stages))
        self.final_ids = [s.stage_id for s in self.order if s.final_output] or [
            self.order[-1].stage_id
        ]
        connectors = dict(getattr(cfg, "connectors", None) or {})
        self._edge_connector: dict[tuple[int, int], str] = {
            (e.from_stage, e.to_stage): e.connector for e in (getattr(cfg, "edges", None) or [])
        }
        self.stages: dict[int, StageHandle] = {}
        for spec in self.order:
            init = StageInit(
                stage=cfg.stage(spec.stage_id),
                spec=spec,
                pipeline=cfg.pipeline,
                connectors=connectors,
            )
            self.stages[spec.stage_id] = (
                stage_factory(init)
                if stage_factory is not None
                else StageClient(init, startup_timeout_s=startup_timeout_s)
            )
        # Whether any stage streams its output: requests then run in streaming.py.
        self.streamed = any(s.stream_output for s in self.order)
        self._closed = False

    def edge_connector(self, from_stage: int, to_stage: int | None) -> str | None:
        """The connector configured for an edge (None: inline, or no next stage)."""
        return None if to_stage is None else self._edge_connector.get((from_stage, to_stage))

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Start the stages; if one fails, stop the others and re-raise.

        Stages on disjoint devices start concurrently, and so do stages that share a GPU when
        each holds itself to a stated share of it without measuring the device (see
        `_start_apart`). Other stages on one GPU start one after another in topological order:
        a vLLM engine measures the device's free memory while it profiles, and another stage
        loading onto the same GPU at that moment skews that measurement or fails it ("Error in
        memory profiling").
        """
        t0 = time.monotonic()
        for spec in self.order:
            if spec.stream_output and not self.stages[spec.stage_id].streams:
                raise ValueError(
                    f"stage {spec.stage_id} ({spec.name}) streams its output, which its "
                    "runner here does not relay"
                )
        starts: dict[int, asyncio.Future] = {}
        for sid, stage in self.stages.items():
            before = [starts[o] for o in starts if self._start_apart(sid, o)]
            starts[sid] = asyncio.ensure_future(self._start_after(stage, before))
        results = await asyncio.gather(*starts.values(), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            topo = self.cfg.topology
            for src, dst in topo.edges:
                # A remote stage that has no node yet says where it listens once one registers.
                dst_stage = self.stages[dst]
                if topo.streams(src, dst) and dst_stage.ready and dst_stage.edge_address is None:
                    errors.append(
                        ValueError(
                            f"stage {dst} ({topo.stage(dst).name}) reads a streamed edge, but "
                            "its runner opens no stage-to-stage channel (only asyncio stages, "
                            "stages.loop.AsyncStageLoop, do)"
                        )
                    )
        if errors:
            await self.aclose()
            raise errors[0]
        logger.info(
            "pipeline %s: %d stage(s) ready in %.1f s",
            self.cfg.pipeline,
            len(self.stages),
            time.monotonic() - t0,
        )

    def shutdown(self) -> None:
        """Stop every stage and everything they started, all at once (a stage may take
        seconds to exit). Blocking, idempotent, callable from any thread but the event loop's;
        on the loop use `aclose`."""
        if self._closed:
            return
        self._closed = True
        threads = [
            threading.Thread(target=stage.shutdown, name=f"omni-stop-{sid}")
            for sid, stage in self.stages.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    async def aclose(self) -> None:
        """`shutdown` for the event loop: stages stop concurrently in threads, the loop
        keeps serving meanwhile."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(asyncio.to_thread(s.shutdown) for s in self.stages.values()))

    def healthy(self) -> bool:
        return not self._closed and all(s.ready for s in self.stages.values())

    def unhealthy_stages(self) -> list[int]:
        return [sid for sid, s in self.stages.items() if not s.ready]

    def final_info(self) -> StageInfo | None:
        """The final stage's Ready info (None until it was first ready)."""
        return self.stages[self.final_ids[0]].describe()

    def final_limits(self) -> RequestLimits | None:
        """The request limits the final stage announced (None until it was first ready)."""
        return self.stages[self.final_ids[0]].limits()

    def _start_apart(self, a: int, b: int) -> bool:
        """Stages on one GPU may start together only if neither measures the device while it
        starts and their stated shares of it fit side by side."""
        sa, sb = self.cfg.stage(a), self.cfg.stage(b)
        if not sa.device_ids & sb.device_ids:
            return False
        if sa.profiles_gpu_at_start or sb.profiles_gpu_at_start:
            return True
        return sa.gpu_share is None or sb.gpu_share is None or sa.gpu_share + sb.gpu_share > 1

    @staticmethod
    async def _start_after(stage: StageHandle, before: list[asyncio.Future]) -> None:
        for other in before:
            await asyncio.shield(other)  # raises if that stage failed: this one does not start
        await stage.start()

    # ---- requests ----------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        params: Any,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> PipelineResult:
        """Run one request through every stage. `on_progress` (streaming requests, whose
        params say `stream`) is called on this loop with each stage's Progress messages, in the
        order the stages send them (a headless node relays its stages' Progress)."""
        t0 = time.perf_counter()
        if self.streamed:
            run = StreamedRun(self, request_id, params, on_progress, None)
            return self._result(await run.run(), run.stage_s, t0, run.metrics)
        outputs: dict[int, Any] = {}
        producers: list[int] = []  # stages that handed a payload on for this request
        stage_s = 0.0
        metrics: dict[str, Any] = {}
        try:
            for spec in self.order:
                sid = spec.stage_id
                consumers = [s.stage_id for s in self.order if sid in s.inputs]
                to_stage = consumers[0] if consumers else None
                msg = Submit(
                    request_id=request_id,
                    params=stage_params(spec.kind, params),
                    inputs={i: outputs.pop(i) for i in spec.inputs if i in outputs},
                    out_connector=self._edge_connector.get((sid, to_stage))
                    if to_stage is not None
                    else None,
                    to_stage=to_stage,
                )
                if to_stage is not None:
                    producers.append(sid)  # before the await: its reply may come after a cancel
                result = await self.stages[sid].submit(msg, on_progress=on_progress)
                absorb_connector_stats(result)  # the stage's connector counters -> /metrics
                if result.error is not None:
                    raise StageRequestError(sid, result.error, result.error_field)
                stage_s += result.stage_s
                # asdict would deep-copy the output; stage_s feeds the x-omni-stage-timings header
                metrics[f"stage_{sid}"] = {**result.metrics, "stage_s": result.stage_s}
                outputs[sid] = result.output
        except BaseException:
            self._release_payloads(request_id, producers)
            raise
        return self._result(outputs, stage_s, t0, metrics)

    def _result(
        self, outputs: dict[int, Any], stage_s: float, t0: float, metrics: dict[str, Any]
    ) -> PipelineResult:
        finals = {sid: outputs.get(sid) for sid in self.final_ids}
        images: list[bytes] = []
        for out in finals.values():
            if isinstance(out, list) and all(isinstance(b, bytes) for b in out):
                images.extend(out)
        return PipelineResult(images, stage_s, time.perf_counter() - t0, metrics, finals)

    async def stream(
        self,
        request_id: str,
        params: Any,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> AsyncIterator[OutputChunk | PipelineResult]:
        """Run one request; yield the final stage's chunks as they come (OutputChunk, in
        order), then the PipelineResult. See the module docstring. Raises as `generate`."""
        if not self.streamed:
            yield await self.generate(request_id, params, on_progress)
            return
        t0 = time.perf_counter()
        # The final stages' windows bound it: a stage emits no more than that unconsumed.
        bound = sum(s.stream_window for s in self.order if s.stage_id in self.final_ids)
        queue: asyncio.Queue = asyncio.Queue(maxsize=bound)
        run = StreamedRun(self, request_id, params, on_progress, queue)
        task = asyncio.ensure_future(run.run())
        try:
            while True:
                if not queue.empty():
                    item = queue.get_nowait()
                elif task.done():
                    break
                else:
                    getter = asyncio.ensure_future(queue.get())
                    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        continue
                    item = getter.result()
                if task.done() and task.exception() is not None:
                    break  # failed: the error below, not the chunks left
                chunk, relay = item
                yield OutputChunk(chunk.from_stage, chunk.seq, plain_payload(chunk.payload))
                relay.consumed(chunk.seq)  # the caller is done with it: the stage may go on
            outputs = await task  # raises the request's error
            yield self._result(outputs, run.stage_s, t0, run.metrics)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _release_payloads(self, request_id: str, producers: list[int]) -> None:
        """The request failed or was cancelled: every stage that produced a payload for it
        drops it now (an abort releases what a stage emitted; a payload the consumer already
        read is released already, so this is a no-op then)."""
        for sid in producers:
            try:
                self.stages[sid].cancel(request_id)
            except Exception:  # a failure path must not hide the request's own error
                logger.exception("abort of %s in stage %d failed", request_id, sid)

    # ---- metrics -----------------------------------------------------------------------
    def engine_metrics(self) -> list[tuple[int, str, list]]:
        """(stage id, stage name, the stage's vLLM metric families) for each stage that
        reports its engine's own metrics (local AR stages)."""
        out = []
        for sid, s in self.stages.items():
            families = s.engine_metrics()
            if families:
                out.append((sid, self.cfg.stage(sid).name, families))
        return out

    def stage_stats(self) -> list[dict[str, Any]]:
        out = []
        for sid, s in self.stages.items():
            st = s.stats()
            out.append(
                {
                    "stage_id": sid,
                    "kind": s.kind,
                    "up": 1.0 if st.up else 0.0,
                    "restarts": st.restarts,
                    "deaths": st.deaths,
                    "stalls": st.stalls,
                    "completed": st.completed,
                    "failed": st.failed,
                    "in_flight": st.in_flight,
                    "busy_seconds": st.busy_s,
                    "cache_skipped": dict(st.cache_skipped),
                    "first_output_seconds": st.first_output_s,
                    "first_outputs": st.first_outputs,
                }
            )
        return out

    def replica_stats(self) -> list[tuple[int, Any]]:
        """(stage id, ReplicaStats) for every replica of the replicated stages."""
        return [(sid, r) for sid, s in self.stages.items() for r in s.replica_stats()]
