"""The image-generation handler: validate, route through the orchestrator, shape the response."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import logging
import time
import uuid
import zipfile
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from ..common.media import MEDIA_TYPES
from ..common.messages import GenerationParams, Progress
from ..orchestrator import Orchestrator, StageRequestError, StageUnavailableError
from ..pipelines import get_pipeline
from .admission import Admission, Ticket
from .errors import APIError, invalid, unavailable
from .lora_adapters import LoraAdapters
from .protocol import ImageLimits, ValidRequest
from .request_fields import FamilyFields
from .streaming import KEEPALIVE, completed_event, error_event, progress_events
from .url_store import UrlStore
from .validation import parse_body, validate_request

logger = logging.getLogger("vllm_omni_plugin.serving")

# A streaming response writes at least this often (SSE comments when nothing else happens), so a
# client that went away is noticed within about this long even in a long stage.
KEEPALIVE_S = 1.0


class ClientDisconnected(Exception):
    pass


@dataclass(frozen=True)
class FileAnswer:
    """response_format "file": the bytes, their media type and a download file name."""

    content: bytes
    media_type: str
    filename: str


def answer(data: dict | FileAnswer, headers: dict[str, str]) -> Response:
    """The HTTP response of `ImageService.respond`'s result."""
    if isinstance(data, FileAnswer):
        disposition = f'attachment; filename="{data.filename}"'
        return Response(
            data.content,
            media_type=data.media_type,
            headers={**headers, "content-disposition": disposition},
        )
    return JSONResponse(data, headers=headers)


FILE_EXTENSIONS = {"png": "png", "jpeg": "jpg", "webp": "webp"}


def file_answer(images: list[bytes], output_format: str, request_id: str) -> FileAnswer:
    """One image: its bytes; several: a zip of them (image_0.png, image_1.png, ...)."""
    ext = FILE_EXTENSIONS[output_format]
    if len(images) == 1:
        return FileAnswer(images[0], MEDIA_TYPES[output_format], f"{request_id}.{ext}")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:  # the images are compressed
        for i, image in enumerate(images):
            zf.writestr(f"image_{i}.{ext}", image)
    return FileAnswer(out.getvalue(), "application/zip", f"{request_id}.zip")


def limits_from(orchestrator: Orchestrator, serving: Any) -> ImageLimits:
    """Bounds the final stage announced in its Ready info (what its engine enforces) + `serving:`."""
    limits = orchestrator.final_limits()
    if limits is None:
        raise RuntimeError("the final stage announced no request limits")
    return ImageLimits.build(limits, serving, FamilyFields.from_info(orchestrator.final_info()))


class ImageService:
    def __init__(
        self,
        orchestrator: Orchestrator,
        limits: ImageLimits,
        served_names: list[str],
        url_store: UrlStore | None = None,
        pipeline: str = "",
        request_timeout_s: float | None = None,
        admission: Admission | None = None,
        edit_url_hosts: tuple[str, ...] = (),
        lora: LoraAdapters | None = None,
    ):
        self.orchestrator = orchestrator
        # Requests held at once (running + `serving.max_queued_requests` waiting); 429 beyond.
        self.admission = admission or Admission(8, 32, "serving.max_queued_requests")
        # `serving.edit_url_hosts`: hosts whose http(s) URLs an edit's `url` may name.
        self.edit_url_hosts = edit_url_hosts
        # `serving.request_timeout_s`: past it a request fails with 504 and its work is
        # aborted in every stage (None: no limit).
        self.request_timeout_s = request_timeout_s
        self.pipeline = pipeline
        self.limits = limits
        self.served_names = served_names
        self.url_store = url_store or UrlStore()
        self.outcomes: Counter[str] = Counter()  # status code -> count, for /metrics
        # The served LoRA adapters (request names resolved and their files checked here).
        self.lora = lora or LoraAdapters(orchestrator)

    def check(self, body: bytes) -> ValidRequest:
        """Parse and validate a request body; APIError (4xx/503) before any stage is touched."""
        data = parse_body(body)
        valid = validate_request(data, self.limits)
        if self.pipeline and get_pipeline(self.pipeline).requires_input_image:
            raise invalid(
                f"the {self.pipeline} pipeline edits images: use POST /v1/images/edits",
                "image",
                "unsupported_endpoint",
            )
        if self.pipeline and get_pipeline(self.pipeline).stages[-1].emits == "video":
            raise invalid(
                f"the {self.pipeline} pipeline makes videos: use POST /v1/videos",
                None,
                "unsupported_endpoint",
            )
        model = data.get("model")
        if model is not None and model not in self.served_names:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        if not self.orchestrator.healthy():
            raise unavailable(
                f"stage(s) {self.orchestrator.unhealthy_stages()} are restarting; retry shortly"
            )
        return self.with_lora(valid)

    def with_lora(self, valid: ValidRequest) -> ValidRequest:
        """The request's `lora` names resolved to served adapters, files checked (4xx)."""
        refs = valid.extensions.get("lora")
        if not refs:
            return valid
        return dataclasses.replace(
            valid, extensions={**valid.extensions, "lora": self.lora.resolve(refs)}
        )

    async def generate(self, body: bytes, base_url: str, disconnected: Any) -> tuple[dict, dict]:
        """(response body, timing headers). Raises APIError for every failure."""
        t0 = time.perf_counter()
        ticket = self.admission.admit()
        try:
            return await self.respond(self.check(body), t0, base_url, disconnected, ticket)
        finally:
            ticket.release()

    async def respond(
        self,
        valid: ValidRequest,
        t0: float,
        base_url: str,
        disconnected: Any,
        ticket: Ticket,
        owner: str | None = None,
    ) -> tuple[dict | FileAnswer, dict]:
        """The non-streaming response of a checked, admitted request (the caller releases its
        ticket): its JSON body, or the image file(s) themselves for response_format "file".
        `owner`: who may fetch its `url` files (None: anyone with a key)."""
        request_id = f"img-{uuid.uuid4().hex}"
        result = await self._run(request_id, valid, disconnected, ticket)
        server_ms = (time.perf_counter() - t0) * 1e3
        headers = {
            "x-omni-request-id": request_id,
            "x-omni-server-ms": f"{server_ms:.3f}",
            "x-omni-stage-ms": f"{result.stage_s * 1e3:.3f}",
            "x-omni-stage-timings": stage_timings(result.metrics, server_ms),
        }
        if valid.response_format == "file":
            return file_answer(result.images, valid.output_format, request_id), headers
        out = []
        for image in result.images:
            if valid.response_format == "url":
                token = self.url_store.put(image, MEDIA_TYPES[valid.output_format], owner)
                out.append({"url": f"{base_url}v1/images/files/{token}"})
            else:
                out.append({"b64_json": base64.b64encode(image).decode("ascii")})
        response = {
            "created": int(time.time()),
            "data": out,
            "output_format": valid.output_format,
            "size": f"{valid.width}x{valid.height}",
        }
        return response, headers

    async def stream(
        self, valid: ValidRequest, request_id: str, ticket: Ticket
    ) -> AsyncIterator[str]:
        """SSE text of a streaming request (serving/streaming.py has the event shapes).

        Its progress and previews arrive from the stages while it runs. Closing this generator
        (the client went away: Starlette cancels it, or a write fails, which the keep-alive
        comments make happen within a second) cancels the orchestrator call, which aborts the
        request in the stage that holds it. Failures after the 200 are `error` events. It
        releases its admission `ticket` when it ends (the route also does, in case it never
        starts).
        """
        queue: asyncio.Queue[Progress | None] = asyncio.Queue()
        work = asyncio.ensure_future(
            self._started(ticket, request_id, self._params(valid), on_progress=queue.put_nowait)
        )
        work.add_done_callback(lambda _f: queue.put_nowait(None))
        loop = asyncio.get_running_loop()
        timeout = self.request_timeout_s
        deadline = None if timeout is None else loop.time() + timeout
        outcome = "499"  # unless the stream ends below
        try:
            while True:
                wait = KEEPALIVE_S if deadline is None else min(KEEPALIVE_S, deadline - loop.time())
                if wait <= 0:
                    logger.warning(
                        "request %s aborted: unfinished after %.0f s", request_id, timeout
                    )
                    outcome = "504"
                    yield error_event(_timeout_error(timeout).body())
                    return
                try:
                    item = await asyncio.wait_for(queue.get(), wait)
                except asyncio.TimeoutError:
                    yield KEEPALIVE
                    continue
                if item is None:
                    break
                for event in progress_events(valid, item):
                    yield event
            try:
                result = self._result(work)
            except APIError as exc:
                outcome = str(exc.status)
                yield error_event(exc.body())
                return
            outcome = "200"
            for image in result.images:
                yield completed_event(valid, image, result.metrics)
        finally:
            if not work.done():
                work.cancel()  # aborts the request in the stage holding it
                if outcome == "499":
                    logger.info("request %s cancelled: client disconnected", request_id)
            ticket.release()
            self.outcomes[outcome] += 1

    @staticmethod
    def _params(valid: ValidRequest) -> GenerationParams:
        return GenerationParams(
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
            stream=valid.stream,
            partial_images=valid.partial_images if valid.stream else 0,
            cache=valid.cache,
            input_images=list(valid.input_images),
            mask=valid.mask,
            knobs=dict(valid.knobs),
            lora=list(valid.extensions.get("lora") or []),
        )

    @staticmethod
    def _result(work: asyncio.Future):
        try:
            return work.result()
        except StageUnavailableError as exc:
            raise unavailable(str(exc)) from None
        except StageRequestError as exc:
            if exc.field is not None:
                raise invalid(exc.message, exc.field) from None
            raise APIError(500, str(exc), code="stage_error") from None

    async def _run(self, request_id: str, valid: ValidRequest, disconnected: Any, ticket: Ticket):
        params = self._params(valid)
        if valid.user is not None:
            logger.info("request %s is for user %r", request_id, valid.user)
        work = asyncio.ensure_future(self._started(ticket, request_id, params))
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
            raise _timeout_error(self.request_timeout_s)
        return self._result(work)

    async def _started(
        self, ticket: Ticket, request_id: str, params: GenerationParams, **kwargs: Any
    ):
        """The orchestrator call once the request has a running slot (its wait counts toward
        the request's timeout)."""
        await ticket.start()
        return await self.orchestrator.generate(request_id, params, **kwargs)


def _timeout_error(limit_s: float) -> APIError:
    return APIError(
        504,
        f"the request did not finish within the server's limit of "
        f"{limit_s:g} s (serving.request_timeout_s); it was cancelled",
        code="request_timeout",
        type="timeout_error",
    )


def stage_timings(metrics: dict, server_ms: float) -> str:
    """Where a request's time went, in ms, as compact JSON: each stage from receipt to reply
    ("stage_<id>"), the VAE decode inside a diffusion stage where it reports one ("decode"), and
    the rest ("other": validation, control hops, payload handoffs, encoding). An AR stage also
    reports its engine's time to first token and time per output token after it
    ("stage_<id>_ttft", "stage_<id>_tpot": parts of "stage_<id>", not added to the sum)."""
    out: dict[str, float] = {}
    stages = 0.0
    for name, m in metrics.items():
        out[name] = round(m.get("stage_s", 0.0) * 1e3, 1)
        stages += out[name]
        if "decode_s" in m:
            out["decode"] = round(m["decode_s"] * 1e3, 1)
        for key in ("ttft", "tpot"):
            if m.get(f"{key}_s") is not None:
                out[f"{name}_{key}"] = round(m[f"{key}_s"] * 1e3, 3)
    out["other"] = round(server_ms - stages, 1)
    return json.dumps(out, separators=(",", ":"))
