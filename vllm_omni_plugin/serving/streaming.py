"""Server-sent events of a streaming image generation (`stream: true`), as OpenAI streams them.

    event: image_generation.partial_image      (partial_images of them, in index order)
    event: image_generation.completed          (one per image of the request)

Each `data:` is one JSON object whose `type` repeats the event name; the fields are those of the
openai package's ImageGenPartialImageEvent / ImageGenCompletedEvent. Our progress (vendor
extension) goes as SSE comments, `: omni.progress {...}`, which every SSE client skips (the openai
client too), or, when the request sets `progress_events: true`, as `event: omni.progress` events
for UIs built on a browser EventSource. An error after the stream started is an
`event: error` whose data carries OpenAI's error object (the openai client raises APIError).
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from ..common.messages import Progress
from .protocol import ValidRequest

KEEPALIVE = ": keep-alive\n\n"


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _common(valid: ValidRequest, image: bytes) -> dict[str, Any]:
    return {
        "b64_json": base64.b64encode(image).decode("ascii"),
        "created_at": int(time.time()),
        "size": f"{valid.width}x{valid.height}",
        "quality": valid.quality,
        "background": valid.background,
        "output_format": valid.output_format,
    }


def partial_image_event(valid: ValidRequest, image: bytes, index: int) -> str:
    kind = f"{valid.event_prefix}.partial_image"  # image_edit.* for edits
    return sse(kind, {"type": kind, **_common(valid, image), "partial_image_index": index})


def usage(metrics: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage object. What a pipeline knows: the image tokens its AR stage generated
    (GLM-Image's prior); prompt tokens are not counted by the stages, so they read 0."""
    out_tokens = sum(int(m.get("generated_tokens", 0)) for m in metrics.values())
    return {
        "input_tokens": 0,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
        "output_tokens": out_tokens,
        "total_tokens": out_tokens,
    }


def completed_event(valid: ValidRequest, image: bytes, metrics: dict[str, Any]) -> str:
    kind = f"{valid.event_prefix}.completed"
    return sse(kind, {"type": kind, **_common(valid, image), "usage": usage(metrics)})


def progress_event(p: Progress, as_event: bool) -> str:
    data = {
        "type": "omni.progress",
        "stage_id": p.stage_id,
        "stage": p.stage,
        "step": p.step,
        "total_steps": p.total_steps,
    }
    if as_event:
        return sse("omni.progress", data)
    return f": omni.progress {json.dumps(data, separators=(',', ':'))}\n\n"


def error_event(body: dict[str, Any]) -> str:
    """`body` is APIError.body(): {"error": {message, type, param, code}}."""
    return sse("error", {"type": "error", **body})


def progress_events(valid: ValidRequest, p: Progress) -> list[str]:
    """What one Progress message becomes: its preview images (one partial_image event per image
    of the request, all with the preview's index), then the progress line."""
    out = []
    if p.preview is not None and p.preview_index is not None:
        out.extend(partial_image_event(valid, im, p.preview_index) for im in p.preview)
    out.append(progress_event(p, valid.progress_events))
    return out
