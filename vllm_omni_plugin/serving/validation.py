"""Turn a raw request body into a ValidRequest, or an OpenAI-shaped 4xx. Nothing here touches a
stage: every bound is checked in the API server against the limits the final stage announced
(common/limits.py holds them, the diffusion engine computes them; nothing here repeats that arithmetic) and `serving:`."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import ValidationError

from ..common.limits import MAX_PARTIAL_IMAGES
from . import cache_field
from .errors import APIError, invalid
from .protocol import ImageGenerationRequest, ImageLimits, ValidRequest
from .request_fields import EDIT_ONLY, GENERATIONS, FamilyFields, split_fields

MAX_BODY_BYTES = 1 << 20  # far above any legal request (prompts are bounded in characters)
# No request field nests more than a couple of levels; deeper bodies are refused (400) instead
# of recursing through them.
MAX_JSON_DEPTH = 32
# Up to nine digits an axis: any size a client means is read, and then told its range.
SIZE_RE = re.compile(r"^([0-9]{1,9})x([0-9]{1,9})$")


def parse_body(body: bytes) -> dict[str, Any]:
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
    return json_object(body)


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an OpenAI-shaped 400."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid("request body must be a JSON object", None, "invalid_json")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise _too_deep()
    return data


def json_depth(value: Any) -> int:
    """How deep arrays and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _too_deep() -> APIError:
    return invalid(
        f"request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels",
        None,
        "invalid_json",
    )


def _pydantic_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = err.get("loc", ())
    param = str(loc[0]) if loc else None  # a union adds its member's name after the field
    kind = err.get("type", "")
    if kind == "missing":
        return invalid(f"missing required parameter '{param}'", param, "missing_required_parameter")
    if kind == "literal_error":
        return invalid(f"invalid value for '{param}': {err['msg']}", param, "invalid_value")
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return invalid(f"invalid type for '{param}': {err['msg']}", param, "invalid_type")
    return invalid(f"invalid value for '{param}': {err['msg']}", param, "invalid_value")


def parse_size(size: str | None, limits: ImageLimits) -> tuple[int, int]:
    lim = limits.stage
    if size is None or size == "auto":
        return lim.default_width, lim.default_height
    match = SIZE_RE.match(size)
    if match is None:
        raise invalid(f"size must look like 'WIDTHxHEIGHT' (e.g. '64x64'), got {size!r}", "size")
    width, height = int(match.group(1)), int(match.group(2))
    g = lim.granularity
    for name, value, low, top in (
        ("width", width, lim.min_width, lim.max_width),
        ("height", height, lim.min_height, lim.max_height),
    ):
        if not low <= value <= top:
            raise invalid(f"size {size}: {name} {value} is outside [{low}, {top}]", "size")
        if value % g:
            raise invalid(f"size {size}: {name} {value} is not a multiple of {g}", "size")
    return width, height


def output_format(value: Any) -> Any:
    """`output_format` as clients spell it: any case, "jpg" for "jpeg"."""
    if isinstance(value, str):
        value = value.lower()
        return "jpeg" if value == "jpg" else value
    return value


def validate_request(
    data: dict[str, Any], limits: ImageLimits, route: str = GENERATIONS
) -> ValidRequest:
    """Every field of an image request applied or refused (request_fields.py), then checked
    against the stage's limits; `route` is "generations" or "edits" (whose uploads and URLs
    the caller has taken out of `data`)."""
    if "output_format" in data:
        data = {**data, "output_format": output_format(data["output_format"])}
    family = limits.family or FamilyFields()
    common, knobs, extensions = split_fields(route, data, family)
    try:
        req = ImageGenerationRequest.model_validate(
            {k: v for k, v in common.items() if k not in EDIT_ONLY}
        )
    except ValidationError as exc:
        raise _pydantic_error(exc) from None
    family.check_used(
        {"guidance_scale": req.guidance_scale, "negative_prompt": req.negative_prompt, **knobs}
    )
    _refuse_unread(req)

    if not req.prompt.strip():
        raise invalid("prompt must not be empty", "prompt")
    for name, text, most in (
        ("prompt", req.prompt, limits.max_prompt_chars),
        ("negative_prompt", req.negative_prompt, limits.max_negative_prompt_chars),
    ):
        if text is not None and len(text) > most:
            raise invalid(
                f"{name} has {len(text)} characters; the limit is {most}",
                name,
                "string_above_max_length",
            )
    if not 1 <= req.n <= limits.max_n:
        raise invalid(f"n must be between 1 and {limits.max_n}, got {req.n}", "n")
    width, height = parse_size(req.size, limits)
    steps = req.num_inference_steps
    if steps is not None and not 1 <= steps <= limits.stage.max_steps:
        raise invalid(
            f"num_inference_steps must be between 1 and {limits.stage.max_steps}, got {steps}",
            "num_inference_steps",
        )
    guidance = req.guidance_scale
    if guidance is not None and (not math.isfinite(guidance) or not 0 <= guidance <= 100):
        raise invalid("guidance_scale must be a finite number in [0, 100]", "guidance_scale")
    if req.seed is not None and not 0 <= req.seed <= limits.stage.max_seed:
        raise invalid(f"seed must be an integer in [0, {limits.stage.max_seed}]", "seed")
    partial = req.partial_images
    if partial is not None and not 0 <= partial <= MAX_PARTIAL_IMAGES:
        raise invalid(
            f"partial_images must be between 0 and {MAX_PARTIAL_IMAGES}, got {partial}",
            "partial_images",
        )
    return ValidRequest(
        cache=cache_field.checked(req.cache),
        prompt=req.prompt,
        n=req.n,
        width=width,
        height=height,
        response_format=req.response_format,
        output_format=req.output_format,
        output_compression=req.output_compression,
        seed=req.seed,
        num_inference_steps=steps,
        guidance_scale=None if guidance is None else float(guidance),
        negative_prompt=req.negative_prompt,
        stream=bool(req.stream),
        partial_images=partial or 0,
        progress_events=bool(req.progress_events),
        quality=_echo(req.quality),
        background=_echo(req.background),
        knobs=knobs,
        extensions=extensions,
        user=req.user,
    )


def _refuse_unread(req: ImageGenerationRequest) -> None:
    """A field whose value only matters in a stream, or for a lossy format, is refused where
    the request would never read it (never accepted and ignored)."""
    if req.stream:
        if req.response_format in ("file", "url"):
            raise invalid(
                f"response_format '{req.response_format}' does not apply to a stream: its "
                "events carry the images as b64_json; drop stream or response_format",
                "response_format",
            )
    else:
        if req.partial_images:
            raise invalid(
                "partial_images are sent only in a stream (stream: true)", "partial_images"
            )
        if req.progress_events:
            raise invalid(
                "progress_events shape a stream's progress (stream: true)", "progress_events"
            )
    if req.output_compression is not None and req.output_format == "png":
        raise invalid(
            "output_compression is the JPEG/WEBP quality; PNG is lossless: send output_format "
            "jpeg or webp, or drop output_compression",
            "output_compression",
        )


def _echo(value: Any) -> str:
    """quality/background as stream events echo them: the request's string, else "auto"."""
    return value if isinstance(value, str) and value else "auto"
