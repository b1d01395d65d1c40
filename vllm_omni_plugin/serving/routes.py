"""HTTP routes our endpoint plugin attaches to vLLM's app (stage-config mode only).

All paths are under /v1, so vLLM's --api-key middleware guards them like its own routes.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Awaitable, Callable

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .admission import ReleasingStream
from .bodies import read_body, refuse_body
from .errors import APIError
from .handlers import ClientDisconnected, ImageService, answer
from .owners import owner_of
from .protocol import ValidRequest
from .request_fields import EDITS, GENERATIONS, body_schema
from .validation import MAX_BODY_BYTES

router = APIRouter()

# Off by default: the stage-description route exists for tests and operators who turn it on.
DESCRIBE_STAGES_ENV = "VLLM_OMNI_DESCRIBE_STAGES"


def _service(request: Request) -> ImageService:
    service = getattr(request.app.state, "omni_images", None)
    if service is None:
        raise APIError(503, "the image pipeline is not initialised", code="not_ready")
    return service


def _error(exc: APIError) -> JSONResponse:
    return exc.response()


async def _wait_disconnect(request: Request) -> None:
    # The body is fully read, so the only message left to receive is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# The body is read by hand (size limit first, then strict validation), so FastAPI cannot infer
# it: publish the field table's schema (request_fields.py), so /openapi.json describes the route
# (and the fuzz test generates requests from it).
def openapi_body(route: str, content_type: str = "application/json") -> dict:
    return {
        "requestBody": {"required": True, "content": {content_type: {"schema": body_schema(route)}}}
    }


_GENERATIONS_BODY = openapi_body(GENERATIONS)
EDITS_BODY = openapi_body(EDITS, "multipart/form-data")


@router.post("/v1/images/generations", openapi_extra=_GENERATIONS_BODY)
async def create_image(request: Request) -> Response:
    async def check(service: ImageService) -> ValidRequest:
        return service.check(await read_body(request, MAX_BODY_BYTES))

    return await serve_image_request(request, check)


async def serve_image_request(
    request: Request, check: Callable[[ImageService], Awaitable[ValidRequest]]
) -> Response:
    """An image route's answer: admitted before `check(service)` reads and validates the body
    (a 429 costs nothing, uploads count against the same bound), then streamed or answered
    whole, each outcome counted."""
    service = ticket = None
    streaming = False
    try:
        t0 = time.perf_counter()
        service = _service(request)
        ticket = service.admission.admit()
        valid = await check(service)
        if valid.stream:
            request_id = f"img-{uuid.uuid4().hex}"
            streaming = True
            return ReleasingStream(
                service.stream(valid, request_id, ticket),
                media_type="text/event-stream",
                headers={
                    "cache-control": "no-cache",
                    "x-accel-buffering": "no",  # proxies: pass events on as they come
                    "x-omni-request-id": request_id,
                },
                release=ticket.release,
            )
        data, headers = await service.respond(
            valid,
            t0,
            str(request.base_url),
            lambda: _wait_disconnect(request),
            ticket,
            owner_of(request),
        )
    except APIError as exc:
        if service is not None:
            service.outcomes[str(exc.status)] += 1
        return _error(exc)
    except ClientDisconnected:
        service.outcomes["499"] += 1
        return Response(status_code=499)
    finally:
        if ticket is not None and not streaming:
            ticket.release()
    service.outcomes["200"] += 1
    return answer(data, headers)


@router.get("/v1/images/files/{token}")
async def get_image_file(token: str, request: Request) -> Response:
    """A `response_format=url` image, for the key that created it (when the server has keys)."""
    try:
        await refuse_body(request)
        found = _service(request).url_store.get(token, owner_of(request))
    except APIError as exc:
        return _error(exc)
    if found is None:
        return _error(APIError(404, "image not found or expired", param="token", code="not_found"))
    data, media_type = found
    return Response(content=data, media_type=media_type)


@router.get("/v1/omni/stages")
async def describe_stages(request: Request) -> Response:
    """Internal: what each live stage runs with (its Ready info: limits and the settings read
    back from its engine), and its pid. 404 unless VLLM_OMNI_DESCRIBE_STAGES=1 is set for the
    API server; under /v1, so --api-key guards it too. With `?live=1`, each stage also answers
    what it holds right now ("live": the requests in its engine, its count of Submits),
    between two of its steps; null for a stage that is down or cannot be asked (remote)."""
    try:
        await refuse_body(request)
        if os.environ.get(DESCRIBE_STAGES_ENV) != "1":
            raise APIError(404, "not found", code="not_found")
        # Any pipeline's (a chat pipeline has no image service): the engine client's.
        client = getattr(request.app.state, "engine_client", None)
        orchestrator = getattr(client, "orchestrator", None) or _service(request).orchestrator
    except APIError as exc:
        return _error(exc)
    stages = [
        {
            "stage_id": sid,
            "kind": stage.kind,
            "ready": stage.ready,
            "pid": stage.pid,
            "info": {} if (info := stage.describe()) is None else msgspec.to_builtins(info),
        }
        for sid, stage in orchestrator.stages.items()
    ]
    if request.query_params.get("live") == "1":
        for entry, stage in zip(stages, orchestrator.stages.values(), strict=True):
            entry["live"] = await stage.inspect()
    return JSONResponse({"pipeline": orchestrator.cfg.pipeline, "stages": stages})


def _no_text_stage(request: Request) -> JSONResponse:
    pipeline = getattr(getattr(request.app.state, "omni_images", None), "pipeline", "this pipeline")
    return _error(
        APIError(
            400,
            f"{pipeline} has no stage that produces text, so {request.url.path} is not "
            "available; use POST /v1/images/generations.",
            code="unsupported_endpoint",
        )
    )


# Attached only when vLLM registered no text routes (a pipeline without a chat stage).
no_text_router = APIRouter()


@no_text_router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    try:
        await read_body(request, MAX_BODY_BYTES)
    except APIError as exc:
        return _error(exc)
    return _no_text_stage(request)


@no_text_router.post("/v1/completions")
async def completions(request: Request) -> Response:
    try:
        await read_body(request, MAX_BODY_BYTES)
    except APIError as exc:
        return _error(exc)
    return _no_text_stage(request)
