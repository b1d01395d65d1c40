"""HTTP routes of OpenAI's Videos API (/v1/videos jobs); serving/videos.py does the work.

Under /v1, so vLLM's --api-key middleware guards them like its own routes.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from .errors import APIError
from .validation import MAX_BODY_BYTES
from .videos import VideoService, parse_create_body

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


@router.post("/v1/videos")
async def create_video(request: Request) -> Response:
    try:
        service = _service(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise APIError(
                413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large"
            )
        content_type = request.headers.get("content-type", "")
        if content_type.startswith("multipart/form-data") or content_type.startswith(
            "application/x-www-form-urlencoded"
        ):
            form = await request.form()
            data = parse_create_body(b"", content_type, dict(form))
        else:
            body = await request.body()
            if len(body) > MAX_BODY_BYTES:
                raise APIError(
                    413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large"
                )
            data = parse_create_body(body, content_type, None)
        return JSONResponse(service.create(data))
    except APIError as exc:
        return _error(exc)


@router.get("/v1/videos")
async def list_videos(
    request: Request, after: str | None = None, limit: int = 20, order: str = "desc"
) -> Response:
    try:
        return JSONResponse(_service(request).list(after, limit, order))
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
    return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, request: Request) -> Response:
    try:
        return JSONResponse(_service(request).delete(video_id))
    except APIError as exc:
        return _error(exc)
