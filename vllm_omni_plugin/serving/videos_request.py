"""One /v1/videos (or /v1/videos/sync) request body -> the job's checked request, or a 4xx.

Every field is applied or refused (serving/request_fields.py), in JSON or in the multipart
form the official client sends (whose values arrive as text). The frame size comes from `size`
or from `width` + `height` (both given: they must agree); the length from `num_frames` or from
`seconds` at `fps` (both given: they must agree). The family's CFG rule (announced by the
stage): a negative prompt or `guidance_scale_2` without CFG would be ignored, so it is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..common.knobs import cfg_runs
from .errors import APIError, invalid
from .lora_adapters import finish_form_fields, fold_form_field
from .request_fields import VIDEOS, FamilyFields, split_fields
from .validation import SIZE_RE, json_object

MAX_SECONDS = 60
DEFAULT_SECONDS = 4  # OpenAI's default clip length
_INT_FIELDS = ("seconds", "seed", "num_inference_steps", "fps", "num_frames", "width", "height")


@dataclass(frozen=True)
class VideoBounds:
    """What a video request is checked against: the stage's limits and video facts, the
    family's fields, and the deploy file's `serving:` / `videos:` bounds."""

    limits: Any  # common.limits.RequestLimits
    facts: dict[str, Any]  # the stage's video facts (frame_step, default_num_frames)
    family: FamilyFields
    serving: Any  # config ServingLimits
    served_names: list[str]
    default_fps: int
    max_num_frames: int


def check_video_request(data: dict[str, Any], b: VideoBounds) -> dict[str, Any]:
    """The job's request, every field checked and filled; APIError (4xx) otherwise."""
    fields, knobs, extensions = split_fields(VIDEOS, _typed_knobs(data, b.family), b.family)
    reference = _reference(fields.get("input_reference"), b.facts)
    prompt = fields.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("missing required parameter 'prompt'", "prompt", "missing_required_parameter")
    if not prompt.strip():
        raise invalid("prompt must not be empty", "prompt")
    if len(prompt) > b.serving.max_prompt_chars:
        raise invalid(
            f"prompt has {len(prompt)} characters; the limit is {b.serving.max_prompt_chars}",
            "prompt",
            "string_above_max_length",
        )
    negative = fields.get("negative_prompt")
    if negative is not None and (
        not isinstance(negative, str) or len(negative) > b.serving.max_negative_prompt_chars
    ):
        raise invalid("negative_prompt must be a string within the length limit", "negative_prompt")
    model = fields.get("model")
    if model is not None and model not in b.served_names:
        raise APIError(
            404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )
    user = fields.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("invalid type for 'user': expected a string", "user", "invalid_type")
    ints = {k: _int(k, fields.get(k)) for k in _INT_FIELDS}
    width, height = _frame_size(fields.get("size"), ints["width"], ints["height"], b.limits)
    fps = ints["fps"] if ints["fps"] is not None else b.default_fps
    if not 1 <= fps <= 120:
        raise invalid(f"fps must be between 1 and 120, got {fps}", "fps")
    frames = _num_frames(ints["num_frames"], ints["seconds"], fps, b)
    steps = ints["num_inference_steps"]
    if steps is not None and not 1 <= steps <= b.limits.max_steps:
        raise invalid(
            f"num_inference_steps must be between 1 and {b.limits.max_steps}, got {steps}",
            "num_inference_steps",
        )
    guidance = _float("guidance_scale", fields.get("guidance_scale"))
    if guidance is not None and not 0 <= guidance <= 100:
        raise invalid("guidance_scale must be a finite number in [0, 100]", "guidance_scale")
    b.family.check_used({"guidance_scale": guidance, "negative_prompt": negative, **knobs})
    seed = ints["seed"]
    if seed is not None and not 0 <= seed <= b.limits.max_seed:
        raise invalid(f"seed must be an integer in [0, {b.limits.max_seed}]", "seed")
    given = {"guidance_scale": guidance, "negative_prompt": negative, **knobs}
    _check_memory(b, width, height, frames, reference, given)
    seconds = ints["seconds"]
    return {
        "prompt": prompt,
        "negative_prompt": negative,
        "model": model or b.served_names[0],
        "width": width,
        "height": height,
        "num_frames": frames,
        "fps": fps,
        "seconds": str(seconds) if seconds is not None else _seconds(frames, fps),
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "seed": seed,
        "knobs": knobs,
        "extensions": extensions,  # request_fields.EXTENSIONS, checked
        "user": user,
        "input_reference": reference,  # the source image as a lossless PNG, or None
    }


def _check_memory(
    b: VideoBounds, width: int, height: int, frames: int, reference: Any, given: dict
) -> None:
    """The stage's memory plan (announced with its limits): a job that could never fit is
    refused now, naming the setting, not failed later by the stage."""
    memory = b.facts.get("memory")
    if memory is None:
        return
    refused = memory.refusal(
        height,
        width,
        frames=frames,
        cfg=cfg_runs(b.family.cfg, given),
        sources=0 if reference is None else 1,
    )
    if refused is not None:
        field, message = refused
        raise invalid(message, field, "request_too_large")


def no_reference() -> APIError:
    return invalid(
        "this model makes videos from text only; input_reference (image-to-video) needs an "
        "image-to-video model (e.g. Wan2.2 TI2V-5B or I2V-A14B)",
        "input_reference",
        "unsupported_parameter",
    )


def _reference(value: Any, facts: dict[str, Any]) -> bytes | None:
    """The checked source image (the route decoded the upload into a PNG), or None; 400 when
    the model takes none, or needs one and none came."""
    if value in (None, "", b""):
        if facts.get("requires_input_image"):
            raise invalid(
                "missing required parameter 'input_reference': this model makes videos from "
                "an image (PNG, JPEG or WEBP)",
                "input_reference",
                "missing_required_parameter",
            )
        return None
    if not facts.get("max_input_images"):
        raise no_reference()
    if not isinstance(value, bytes):
        raise invalid(
            "input_reference must be an image file (or, in JSON, a data: URL)",
            "input_reference",
            "invalid_type",
        )
    return value


def _typed_knobs(data: dict[str, Any], family: FamilyFields) -> dict[str, Any]:
    """Form values are text: the family's number knobs typed (a non-number is refused)."""
    kinds = {k.name: k.kind for k in family.knobs}
    out = dict(data)
    for name, value in data.items():
        if isinstance(value, str) and kinds.get(name) in ("number", "integer"):
            out[name] = (_int if kinds[name] == "integer" else _float)(name, value)
    return out


def _frame_size(size: Any, width: int | None, height: int | None, limits: Any) -> tuple[int, int]:
    """(width, height) from `size`, or from `width` + `height`; both ways: they must agree."""
    if (width is None) != (height is None):
        missing = "height" if height is None else "width"
        raise invalid(f"give width and height together ({missing} is missing)", missing)
    if size not in (None, ""):
        parsed = _size(size, limits)
        if width is not None and (width, height) != parsed:
            raise invalid(
                f"size {size} and width x height {width}x{height} disagree; give one of them",
                "size",
            )
        return parsed
    if width is None:
        return limits.default_width, limits.default_height
    return _size(f"{width}x{height}", limits, by_axis=True)


def _num_frames(frames: int | None, seconds: int | None, fps: int, b: VideoBounds) -> int:
    step = int(b.facts["frame_step"])
    if seconds is not None and not 1 <= seconds <= MAX_SECONDS:
        raise invalid(f"seconds must be between 1 and {MAX_SECONDS}, got {seconds}", "seconds")
    if frames is None:
        # OpenAI's `seconds`: seconds x fps frames after the first, rounded down to what the
        # VAE's temporal compression allows.
        frames = (seconds or DEFAULT_SECONDS) * fps // step * step + 1
        if frames > b.max_num_frames:
            raise invalid(
                f"{seconds or DEFAULT_SECONDS} s at {fps} fps is {frames} frames; the limit is "
                f"{b.max_num_frames} (videos.max_num_frames)",
                "seconds",
            )
        return frames
    if not 1 <= frames <= b.max_num_frames:
        raise invalid(
            f"num_frames must be between 1 and {b.max_num_frames}, got {frames}", "num_frames"
        )
    if (frames - 1) % step:
        raise invalid(f"num_frames must be 1 + a multiple of {step}, got {frames}", "num_frames")
    if seconds is not None and seconds != math.ceil((frames - 1) / fps):
        raise invalid(
            f"num_frames {frames} at {fps} fps is {_seconds(frames, fps)} s, not the "
            f"{seconds} s asked for; give one of num_frames and seconds",
            "num_frames",
        )
    return frames


def form_dict(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """A form's fields as a dict (a repeated field: its last value), with the `lora[][name]`,
    `lora[][scale]` fields folded into one `lora` list."""
    data: dict[str, Any] = {}
    for name, value in items:
        if isinstance(value, str) and fold_form_field(data, name, value):
            continue
        data[name] = value
    finish_form_fields(data)
    return data


def parse_create_body(body: bytes, content_type: str, form: dict[str, Any] | None) -> dict:
    """JSON, or the multipart form the official client sends (its values arrive as strings;
    `input_reference` is the one file it may carry)."""
    if form is not None:
        for key, value in form.items():
            if hasattr(value, "read") and key != "input_reference":
                raise invalid(
                    f"unknown file parameter '{key}': the source image of an image-to-video "
                    "request is 'input_reference'",
                    key,
                    "unknown_parameter",
                )
        return dict(form)
    return json_object(body)


def _int(name: str, value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,20}", value.strip()):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"invalid type for '{name}': expected an integer", name, "invalid_type")
    return value


def _float(name: str, value: Any) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise invalid(
                f"invalid type for '{name}': expected a number", name, "invalid_type"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"invalid type for '{name}': expected a number", name, "invalid_type")
    return float(value)


def _size(size: Any, limits: Any, by_axis: bool = False) -> tuple[int, int]:
    """`by_axis`: the size came from width and height, so an error names the axis."""
    match = SIZE_RE.match(size) if isinstance(size, str) else None
    if match is None:
        raise invalid(f"size must look like 'WIDTHxHEIGHT' (e.g. '832x480'), got {size!r}", "size")
    width, height = int(match.group(1)), int(match.group(2))
    g = limits.granularity
    for name, value, low, top in (
        ("width", width, limits.min_width, limits.max_width),
        ("height", height, limits.min_height, limits.max_height),
    ):
        if not low <= value <= top or value % g:
            raise invalid(
                f"unsupported size {size}: {name} must be a multiple of {g} in [{low}, {top}]",
                name if by_axis else "size",
            )
    return width, height


def _seconds(frames: int, fps: int) -> str:
    return f"{(frames - 1) / fps:g}"
