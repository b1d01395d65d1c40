"""The stage graph at run time: start every stage, route each request along the frozen topology.

A request visits the stages in topological order. Each stage gets the validated request's
parameters plus its upstream stages' outputs (connector descriptors), and returns its own
output; the final stage returns encoded images. Cancelling `generate` (client disconnect)
aborts the request in the stage that holds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..stages.messages import StageInit, Submit
from .connector_stats import absorb as absorb_connector_stats
from .errors import StageRequestError
from .stage_client import StageClient

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

DEFAULT_STARTUP_TIMEOUT_S = 600.0


@dataclass
class PipelineResult:
    images: list[bytes]
    stage_s: float  # sum of the stages' own times for this request
    total_s: float  # orchestrator time, submit of the first stage to reply of the last
    metrics: dict[str, Any]


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
        stage_factory: Callable[[StageInit], Any] | None = None,  # multi-node: remote.py
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
        self.stages: dict[int, StageClient] = {}
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
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Start all stages concurrently; if one fails, stop the others and re-raise."""
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(stage.start() for stage in self.stages.values()), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.shutdown()
            raise errors[0]
        logger.info(
            "pipeline %s: %d stage(s) ready in %.1f s",
            self.cfg.pipeline,
            len(self.stages),
            time.monotonic() - t0,
        )

    def shutdown(self) -> None:
        """Stop every stage and everything they started. Idempotent, callable from any thread."""
        if self._closed:
            return
        self._closed = True
        for stage in self.stages.values():
            stage.shutdown()

    def healthy(self) -> bool:
        return not self._closed and all(s.ready for s in self.stages.values())

    def unhealthy_stages(self) -> list[int]:
        return [sid for sid, s in self.stages.items() if not s.ready]

    def final_info(self) -> dict[str, Any]:
        return self.stages[self.final_ids[0]].info

    # ---- requests ----------------------------------------------------------------------
    async def generate(self, request_id: str, params: dict[str, Any]) -> PipelineResult:
        t0 = time.perf_counter()
        outputs: dict[int, Any] = {}
        stage_s = 0.0
        metrics: dict[str, Any] = {}
        for spec in self.order:
            sid = spec.stage_id
            consumers = [s.stage_id for s in self.order if sid in s.inputs]
            to_stage = consumers[0] if consumers else None
            msg = Submit(
                request_id=request_id,
                params=params,
                inputs={i: outputs.pop(i) for i in spec.inputs if i in outputs},
                out_connector=self._edge_connector.get((sid, to_stage))
                if to_stage is not None
                else None,
                to_stage=to_stage,
            )
            result = await self.stages[sid].submit(msg)
            absorb_connector_stats(result)  # the stage's connector counters -> /metrics
            if result.error is not None:
                raise StageRequestError(sid, result.error, result.error_field)
            stage_s += result.stage_s
            metrics[f"stage_{sid}"] = dict(result.metrics)  # asdict would deep-copy the output
            outputs[sid] = result.output
        images: list[bytes] = []
        for sid in self.final_ids:
            images.extend(outputs.get(sid) or [])
        return PipelineResult(images, stage_s, time.perf_counter() - t0, metrics)

    # ---- metrics -----------------------------------------------------------------------
    def stage_stats(self) -> list[dict[str, Any]]:
        return [
            {
                "stage_id": sid,
                "kind": s.kind,
                "up": 1.0 if s.ready else 0.0,
                "restarts": s.restarts,
                "deaths": s.deaths,
                "completed": s.completed,
                "failed": s.failed,
                "in_flight": len(s.pending),
                "busy_seconds": s.busy_s,
            }
            for sid, s in self.stages.items()
        ]
