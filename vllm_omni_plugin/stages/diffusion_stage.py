"""A diffusion stage process: our DiffusionEngine driven by control messages.

The loop is the engine's own: drain new messages (requests join at step boundaries), run one
step, send what finished. It blocks on the socket only when the engine is idle. Images are
encoded here (PNG/JPEG/WEBP as each request asked), off the API server's event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ..serving.images import encode_image
from .messages import Abort, Result, Shutdown, StageInit, Submit
from .payloads import StagePayloads

logger = logging.getLogger("vllm_omni_plugin.stages.diffusion")


@dataclass
class _Job:
    received: float
    output_format: str
    compression: int | None


class DiffusionStageRunner:
    def __init__(self, init: StageInit, conn: Connection):
        from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig

        self.init = init
        self.conn = conn
        self.stage_id: int = init.stage.stage_id
        config = DiffusionEngineConfig.from_stage_config(init.stage)
        if config.pipeline_class is None and init.spec.pipeline_class:
            config.pipeline_class = init.spec.pipeline_class
        self.engine = DiffusionEngine(config)
        self.payloads = StagePayloads(init.connectors)
        self.jobs: dict[str, _Job] = {}
        self._stop = False

    def info(self) -> dict[str, Any]:
        """Bounds the API server validates against before anything reaches this stage."""
        spec = self.engine.adapter.spec
        cfg = self.engine.config
        defaults = self.engine.defaults
        return {
            "kind": "diffusion",
            "pipeline_class": type(self.engine.adapter).pipeline_class,
            "granularity": max(spec.granularity, self._config_granularity()),
            "min_size": max(cfg.min_height or spec.min_size, cfg.min_width or spec.min_size),
            "max_height": cfg.max_height or spec.max_size,
            "max_width": cfg.max_width or spec.max_size,
            "max_steps": cfg.max_num_inference_steps,
            "max_batch_size": cfg.max_batch_size,
            "default_height": defaults.get("height", spec.default_height),
            "default_width": defaults.get("width", spec.default_width),
        }

    def _config_granularity(self) -> int:
        owner = getattr(self.init.stage, "diffusion", None)
        return int(getattr(owner, "size_granularity", None) or 1)

    def serve(self) -> None:
        while not self._stop:
            busy = self.engine.has_unfinished()
            # Idle: block for work. Busy: take whatever arrived, then run one step.
            if self.conn.poll(0 if busy else None):
                self._handle(self.conn.recv())
                while not self._stop and self.conn.poll(0):
                    self._handle(self.conn.recv())
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    self._finish(out)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Submit):
            self._submit(msg)
        elif isinstance(msg, Abort):
            if self.jobs.pop(msg.request_id, None) is not None:
                self.engine.abort(msg.request_id)
        elif isinstance(msg, Shutdown):
            self._stop = True

    def _submit(self, msg: Submit) -> None:
        from vllm_omni_plugin.diffusion import GenerationRequest, RequestValidationError

        t0 = time.perf_counter()
        p = msg.params
        try:
            prior = None
            for value in msg.inputs.values():  # GLM-Image: the AR stage's prior token ids
                prior = self.payloads.receive(value)
            req = GenerationRequest(
                request_id=msg.request_id,
                prompt=p["prompt"],
                negative_prompt=p.get("negative_prompt"),
                n=p.get("n", 1),
                height=p.get("height"),
                width=p.get("width"),
                num_inference_steps=p.get("num_inference_steps"),
                guidance_scale=p.get("guidance_scale"),
                seed=p.get("seed"),
                prior_token_ids=prior,
            )
            self.engine.add_request(req)
        except RequestValidationError as exc:
            self._reply(Result(msg.request_id, error=exc.message, error_field=exc.field))
            return
        except Exception as exc:  # a bad payload or engine refusal fails this request only
            logger.exception("request %s rejected", msg.request_id)
            self._reply(Result(msg.request_id, error=f"{type(exc).__name__}: {exc}"))
            return
        self.jobs[msg.request_id] = _Job(
            t0, p.get("output_format", "png"), p.get("output_compression")
        )

    def _finish(self, out: Any) -> None:
        job = self.jobs.pop(out.request_id, None)
        if job is None:  # aborted while its last step ran
            return
        if out.error is not None:
            result = Result(out.request_id, error=out.error, metrics=dict(out.metrics))
        else:
            images = [encode_image(im, job.output_format, job.compression) for im in out.images]
            result = Result(out.request_id, output=images, metrics=dict(out.metrics))
        result.stage_s = time.perf_counter() - job.received
        self._reply(result)

    def _reply(self, result: Result) -> None:
        self.conn.send(result)

    def close(self) -> None:
        self.payloads.close()
