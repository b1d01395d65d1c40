"""HTTP routes of OpenAI's Videos API (/v1/videos jobs); serving/videos.py does the work.

Under /v1, so vLLM's --api-key middleware guards them like its own routes; with keys, each job
is visible only to the key that created it (serving/owners.py). Bodies are counted as they
arrive (serving/bodies.py): 413 past MAX_BODY_BYTES, JSON or form alike.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from ..common.media import MEDIA_TYPES
from .admission import ReleasingStream
from .bodies import read_body, read_form, refuse_body
from .edit_urls import fetch_url
from .edits import MAX_IMAGE_BYTES, open_checked, to_rgb_png
from .errors import APIError, invalid
from .owners import owner_of
from .request_fields import VIDEOS, body_schema
from .validation import MAX_BODY_BYTES
from .videos import ClientGone, VideoService
from .videos_request import form_dict, parse_create_body

router = APIRouter()
# A form may carry one source image (input_reference) besides its text fields.
MAX_FORM_BYTES = MAX_IMAGE_BYTES + MAX_BODY_BYTES


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
    return exc.response()


async def _request_data(request: Request, service: VideoService) -> dict:
    """The create body as a dict (JSON or a form), counted as it arrives (413 past the limit).
    A full job queue answers 429 before the body is read. An `input_reference` (a file, or in
    JSON a data: URL) is checked as the edits route checks its uploads (bytes, format, pixels,
    a complete decode) and becomes a lossless RGB PNG; a model that takes none answers 400
    before the file is read."""
    service.queue.admit()
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data") or content_type.startswith(
        "application/x-www-form-urlencoded"
    ):
        form = await read_form(request, MAX_FORM_BYTES, max_files=4, max_fields=64)
        try:
            data = parse_create_body(b"", content_type, form_dict(form.multi_items()))
            reference = data.get("input_reference")
            if hasattr(reference, "read"):
                service.accepts_reference()
                data["input_reference"] = await reference.read(MAX_IMAGE_BYTES + 1)
        finally:
            await form.close()
    else:
        data = parse_create_body(await read_body(request, MAX_BODY_BYTES), content_type, None)
        reference = data.get("input_reference")
        if isinstance(reference, str) and reference:
            service.accepts_reference()
            hosts = tuple(service.serving.edit_url_hosts)
            data["input_reference"] = await fetch_url(
                reference, "input_reference", hosts, MAX_IMAGE_BYTES
            )
    if isinstance(data.get("input_reference"), bytes) and data["input_reference"]:
        data["input_reference"] = await asyncio.to_thread(_reference_png, data["input_reference"])
    return data


def _reference_png(data: bytes) -> bytes:
    return to_rgb_png(open_checked(data, "input_reference"))


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
        return JSONResponse(
            service.create(await _request_data(request, service), owner_of(request))
        )
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
        data = await _request_data(request, service)
        path, job_id = await service.create_sync(
            data, lambda: _wait_disconnect(request), owner_of(request)
        )
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
        await refuse_body(request)
        if not limit.isascii() or not limit.isdigit():
            raise invalid(f"limit must be an integer, got {limit!r}", "limit")
        return JSONResponse(_service(request).list(after, int(limit), order, owner_of(request)))
    except APIError as exc:
        return _error(exc)


@router.get("/v1/videos/{video_id}")
async def get_video(video_id: str, request: Request) -> Response:
    try:
        await refuse_body(request)
        return JSONResponse(_service(request).get(video_id, owner_of(request)))
    except APIError as exc:
        return _error(exc)


@router.get("/v1/videos/{video_id}/content")
async def get_video_content(
    video_id: str, request: Request, variant: str | None = None
) -> Response:
    try:
        await refuse_body(request)
        path = _service(request).content_path(video_id, variant, owner_of(request))
    except APIError as exc:
        return _error(exc)
    return FileResponse(path, media_type=MEDIA_TYPES["mp4"], filename=f"{video_id}.mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, request: Request) -> Response:
    try:
        await refuse_body(request)
        return JSONResponse(_service(request).delete(video_id, owner_of(request)))
    except APIError as exc:
        return _error(exc)


# A vendor extension (OpenAI's Videos API has no stream): a job's progress as server-sent events.
EVENTS_KEEPALIVE_S = 1.0


@router.get("/v1/videos/{video_id}/events")
async def video_events(video_id: str, request: Request) -> Response:
    """SSE: `event: video.progress` with the video object each time its status or progress
    changes, then one `video.completed` or `video.failed`, and the stream ends. A `: keep-alive`
    comment every second while nothing changes. The stream waits on the service's change
    notices (nothing polls the store), reads the job off the event loop, and counts against
    `videos.max_event_streams` (429 past it)."""
    owner = owner_of(request)
    try:
        await refuse_body(request)
        service = _service(request)
        first = service.get(video_id, owner)
        close_stream = service.queue.open_stream()
    except APIError as exc:
        return _error(exc)

    async def events():
        job, last = first, None
        try:
            while True:
                changed = service.queue.changed()  # before the read: no change is missed
                if job is not None:
                    key = (job["status"], job["progress"])
                    if key != last:
                        last = key
                        done = job["status"] in ("completed", "failed")
                        kind = f"video.{job['status']}" if done else "video.progress"
                        yield f"event: {kind}\ndata: {json.dumps(job)}\n\n"
                        if done:
                            return
                try:
                    await asyncio.wait_for(changed.wait(), EVENTS_KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                try:
                    job = await asyncio.to_thread(service.get, video_id, owner)
                except APIError as exc:  # deleted (or expired) meanwhile
                    yield f"event: error\ndata: {json.dumps(exc.body())}\n\n"
                    return
        finally:
            close_stream()

    return ReleasingStream(
        events(),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache"},
        release=close_stream,
    )
