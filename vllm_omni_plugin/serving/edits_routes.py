"""POST /v1/images/edits (OpenAI's multipart image edit), beside the generations route.

The uploads are read with a byte limit, checked and converted (serving/edits.py) before the
request reaches ImageService, which then serves it exactly like a generation (non-streaming or
SSE with `image_edit.*` events).
"""

from __future__ import annotations

import asyncio
import io

from fastapi import APIRouter, Request
from fastapi.responses import Response
from PIL import Image

from ..pipelines import get_pipeline
from .bodies import read_form
from .edit_urls import fetch_url
from .edits import (
    MAX_EDIT_BODY_BYTES,
    MAX_IMAGE_BYTES,
    auto_size,
    check_topology,
    decode_uploads,
    edit_request,
    form_fields,
    with_uploads,
)
from .errors import APIError, invalid, unavailable
from .handlers import ImageService
from .protocol import ValidRequest
from .routes import EDITS_BODY, serve_image_request

router = APIRouter()


async def check_edit(request: Request, service: ImageService) -> ValidRequest:
    """The whole edit request checked, uploads converted; APIError before any stage."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise invalid(
            "POST /v1/images/edits takes multipart/form-data (image files and fields)",
            None,
            "invalid_content_type",
        )
    # Parsed while it arrives, counted: 413 past MAX_EDIT_BODY_BYTES; uploads spool to disk.
    form = await read_form(request, MAX_EDIT_BODY_BYTES, max_files=32, max_fields=64)
    try:
        data, image_files, mask_file = form_fields(list(form.multi_items()))
        urls = data.pop("url", [])
        topology = get_pipeline(service.pipeline)
        check_topology(topology, [*image_files, *urls], mask_file)
        valid = edit_request(data, service.limits)
        model = data.get("model")
        if model is not None and model not in service.served_names:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        blobs = [await f.read() for f in image_files]
        mask = None if mask_file is None else await mask_file.read()
    finally:
        await form.close()  # uploads over 1 MB were spooled to temporary files
    for url in urls:  # after the files, in order
        blobs.append(await fetch_url(url, "url", service.edit_url_hosts, MAX_IMAGE_BYTES))
    images, mask_png = await asyncio.to_thread(
        decode_uploads, blobs, mask, topology.max_input_aspect_ratio, topology.min_input_side
    )
    if not service.orchestrator.healthy():
        raise unavailable(
            f"stage(s) {service.orchestrator.unhealthy_stages()} are restarting; retry shortly"
        )
    size = None
    if data.get("size") in (None, "auto"):
        with Image.open(io.BytesIO(images[0])) as first:  # reads the header only
            size = auto_size(first.size, service.limits)
    return with_uploads(service.with_lora(valid), images, mask_png, size)


@router.post("/v1/images/edits", openapi_extra=EDITS_BODY)
async def edit_image(request: Request) -> Response:
    return await serve_image_request(request, lambda service: check_edit(request, service))
