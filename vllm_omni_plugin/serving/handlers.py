"""The image-generation handler: validate, route through the orchestrator, shape the response."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections import Counter
from typing import Any

from ..diffusion.limits import RequestLimits
from ..orchestrator import Orchestrator, StageRequestError, StageUnavailableError
from ..stages.messages import GenerationParams
from .errors import APIError, invalid, unavailable
from .images import MEDIA_TYPES
from .protocol import ImageLimits, ValidRequest
from .url_store import UrlStore
from .validation import parse_body, validate_request

logger = logging.getLogger("vllm_omni_plugin.serving")


class ClientDisconnected(Exception):
    pass


def limits_from(orchestrator: Orchestrator, serving: Any) -> ImageLimits:
    """Bounds the final stage announced in its Ready info (what its engine enforces) + `serving:`."""
    return ImageLimits.build(RequestLimits.from_dict(orchestrator.final_info()["limits"]), serving)


class ImageService:
    def __init__(
        self,
        orchestrator: Orchestrator,
        limits: ImageLimits,
        served_names: list[str],
        url_store: UrlStore | None = None,
        pipeline: str = "",
        request_timeout_s: float | None = None,
    ):
        self.orchestrator = orchestrator
        # `serving.request_timeout_s`: past it a request fails with 504 and its work is
        # aborted in every stage (None: no limit).
        self.request_timeout_s = request_timeout_s
        self.pipeline = pipeline
        self.limits = limits
        self.served_names = served_names
        self.url_store = url_store or UrlStore()
        self.outcomes: Counter[str] = Counter()  # status code -> count, for /metrics

    async def generate(self, body: bytes, base_url: str, disconnected: Any) -> tuple[dict, dict]:
        """(response body, timing headers). Raises APIError for every failure."""
        t0 = time.perf_counter()
        data = parse_body(body)
        valid = validate_request(data, self.limits)
        model = data.get("model")
        if model is not None and model not in self.served_names:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        if not self.orchestrator.healthy():
            raise unavailable(
                f"stage(s) {self.orchestrator.unhealthy_stages()} are restarting; retry shortly"
            )
        request_id = f"img-{uuid.uuid4().hex}"
        result = await self._run(request_id, valid, disconnected)
        out = []
        for image in result.images:
            if valid.response_format == "url":
                token = self.url_store.put(image, MEDIA_TYPES[valid.output_format])
                out.append({"url": f"{base_url}v1/images/files/{token}"})
            else:
                out.append({"b64_json": base64.b64encode(image).decode("ascii")})
        response = {
            "created": int(time.time()),
            "data": out,
            "output_format": valid.output_format,
            "size": f"{valid.width}x{valid.height}",
        }
        server_ms = (time.perf_counter() - t0) * 1e3
        headers = {
            "x-omni-request-id": request_id,
            "x-omni-server-ms": f"{server_ms:.3f}",
            "x-omni-stage-ms": f"{result.stage_s * 1e3:.3f}",
            "x-omni-stage-timings": stage_timings(result.metrics, server_ms),
        }
        return response, headers

    async def _run(self, request_id: str, valid: ValidRequest, disconnected: Any):
        params = GenerationParams(
            prompt=valid.prompt,
            negative_prompt=valid.negative_prompt,
            n=valid.n,
            height=valid.height,
            width=valid.width,
            num_inference_steps=valid.num_inference_steps,
            guidance_scale=valid.guidance_scale,
            seed=valid.seed,
            output_format=valid.output_format,
            output_compression=valid.output_compression,
        )
        work = asyncio.ensure_future(self.orchestrator.generate(request_id, params))
        watch = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait(
                {work, watch}, timeout=self.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            watch.cancel()
        if work not in done:
            # Cancelling the orchestrator call aborts the request in the stage holding it.
            work.cancel()
            if watch in done:
                logger.info("request %s cancelled: client disconnected", request_id)
                raise ClientDisconnected(request_id)
            logger.warning(
                "request %s aborted: unfinished after %.0f s", request_id, self.request_timeout_s
            )
            raise APIError(
                504,
                f"the request did not finish within the server's limit of "
                f"{self.request_timeout_s:g} s (serving.request_timeout_s); it was cancelled",
                code="request_timeout",
                type="timeout_error",
            )
        try:
            return work.result()
        except StageUnavailableError as exc:
            raise unavailable(str(exc)) from None
        except StageRequestError as exc:
            if exc.field is not None:
                raise invalid(exc.message, exc.field) from None
            raise APIError(500, str(exc), code="stage_error") from None


def stage_timings(metrics: dict, server_ms: float) -> str:
    """Where a request's time went, in ms, as compact JSON: each stage from receipt to reply
    ("stage_<id>"), the VAE decode inside a diffusion stage where it reports one ("decode"), and
    the rest ("other": validation, control hops, payload handoffs, encoding)."""
    out: dict[str, float] = {}
    for name, m in metrics.items():
        out[name] = round(m.get("stage_s", 0.0) * 1e3, 1)
        if "decode_s" in m:
            out["decode"] = round(m["decode_s"] * 1e3, 1)
    stages = sum(v for k, v in out.items() if k.startswith("stage_"))
    out["other"] = round(server_ms - stages, 1)
    return json.dumps(out, separators=(",", ":"))
