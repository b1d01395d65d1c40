"""HTTP routes of OpenAI's Videos API (/v1/videos jobs); serving/videos.py does the work.

Under /v1, so vLLM's --api-key middleware guards them like its own routes.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from ..common.media import MEDIA_TYPES
from .errors import APIError, invalid
from .request_fields import VIDEOS, body_schema
from .validation import MAX_BODY_BYTES
from .videos import ClientGone, VideoService
from .videos_request import parse_create_body

router = APIRouter()


def _service(request: Request) -> VideoService:
    service = getattr(request.app.state, "omni_videos", None)
    if service is None:
        raise APIError(
            400,
            "this pipeline does not generate videos; /v1/videos needs a video model "
            "(e.g. stage_configs/wan2_2.yaml)",
            code="unsupported_endpoint",
        )
    return service


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _request_data(request: Request) -> dict:
    """The create body as a dict (JSON or a form), its size bounded."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data") or content_type.startswith(
        "application/x-www-form-urlencoded"
    ):
        try:
            form = await request.form()
        except Exception as exc:  # a malformed form is the client's error, not ours
            raise APIError(
                400, f"could not parse the form body: {exc}", code="invalid_body"
            ) from None
        return parse_create_body(b"", content_type, dict(form))
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
    return parse_create_body(body, content_type, None)


# The body is read by hand (JSON or a form), so FastAPI cannot infer it: publish the field
# table's schema (request_fields.py).
VIDEOS_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            ct: {"schema": body_schema(VIDEOS)}
            for ct in ("application/json", "multipart/form-data")
        },
    }
}


@router.post("/v1/videos", openapi_extra=VIDEOS_BODY)
async def create_video(request: Request) -> Response:
    try:
        service = _service(request)
        return JSONResponse(service.create(await _request_data(request)))
    except APIError as exc:
        return _error(exc)


async def _wait_disconnect(request: Request) -> None:
    while True:  # the body is read: the only message left is the disconnect
        if (await request.receive())["type"] == "http.disconnect":
            return


@router.post("/v1/videos/sync", openapi_extra=VIDEOS_BODY)
async def create_video_sync(request: Request) -> Response:
    """The same request as POST /v1/videos, answered with the MP4 itself once it is done (as
    vLLM-Omni's route): a job in the same queue, under the same bounds, with `x-request-id`
    (its id: GET /v1/videos/{id} shows it) and `x-inference-time-s` headers."""
    t0 = time.perf_counter()
    try:
        service = _service(request)
        data = await _request_data(request)
        path, job_id = await service.create_sync(data, lambda: _wait_disconnect(request))
    except APIError as exc:
        return _error(exc)
    except ClientGone:
        return Response(status_code=499)
    return FileResponse(
        path,
        media_type="video/mp4",
        filename=f"{job_id}.mp4",
        headers={
            "x-request-id": job_id,
            "x-inference-time-s": f"{time.perf_counter() - t0:.3f}",
        },
    )


@router.get("/v1/videos")
async def list_videos(
    request: Request, after: str | None = None, limit: str = "20", order: str = "desc"
) -> Response:
    # `limit` arrives as text and is checked here: FastAPI's own 422 is not OpenAI-shaped.
    try:
        if not limit.isascii() or not limit.isdigit():
            raise invalid(f"limit must be an integer, got {limit!r}", "limit")
        return JSONResponse(_service(request).list(after, int(limit), order))
    except APIError as exc:
        return _error(exc)


@router.get("/v1/videos/{video_id}")
async def get_video(video_id: str, request: Request) -> Response:
    try:
        return JSONResponse(_service(request).get(video_id))
    except APIError as exc:
        return _error(exc)


@router.get("/v1/videos/{video_id}/content")
async def get_video_content(
    video_id: str, request: Request, variant: str | None = None
) -> Response:
    try:
        path = _service(request).content_path(video_id, variant)
    except APIError as exc:
        return _error(exc)
    return FileResponse(path, media_type=MEDIA_TYPES["mp4"], filename=f"{video_id}.mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, request: Request) -> Response:
    try:
        return JSONResponse(_service(request).delete(video_id))
    except APIError as exc:
        return _error(exc)


# A vendor extension (OpenAI's Videos API has no stream): a job's progress as server-sent events.
EVENTS_POLL_S = 0.2
EVENTS_KEEPALIVE_S = 1.0


@router.get("/v1/videos/{video_id}/events")
async def video_events(video_id: str, request: Request) -> Response:
    """SSE: `event: video.progress` with the video object each time its status or progress
    changes, then one `video.completed` or `video.failed`, and the stream ends. A `: keep-alive`
    comment every second while nothing changes."""
    try:
        service = _service(request)
        first = service.get(video_id)
    except APIError as exc:
        return _error(exc)

    async def events():
        job, last, quiet = first, None, 0.0
        while True:
            key = (job["status"], job["progress"])
            if key != last:
                last, quiet = key, 0.0
                done = job["status"] in ("completed", "failed")
                kind = f"video.{job['status']}" if done else "video.progress"
                yield f"event: {kind}\ndata: {json.dumps(job)}\n\n"
                if done:
                    return
            elif quiet >= EVENTS_KEEPALIVE_S:
                quiet = 0.0
                yield ": keep-alive\n\n"
            await asyncio.sleep(EVENTS_POLL_S)
            quiet += EVENTS_POLL_S
            try:
                job = service.get(video_id)
            except APIError as exc:  # deleted meanwhile
                yield f"event: error\ndata: {json.dumps(exc.body())}\n\n"
                return

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )
