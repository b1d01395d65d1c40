"""POST /v1/images/edits: OpenAI's multipart form -> a checked ValidRequest, or a 4xx.

Every upload is checked here, in the API server, before any stage sees the request:

- the pipeline takes source images at all (its topology's `max_input_images`), and masks
  (`accepts_mask`): otherwise 400 before any file is opened;
- the body is at most MAX_EDIT_BODY_BYTES (413, counted while reading), each file at most
  MAX_IMAGE_BYTES (413), at most the topology's number of images (400);
- each image is PNG, JPEG or WEBP (its header, not its name or content type), at most
  MAX_IMAGE_PIXELS by its header (400 before a pixel is decoded: a small file can declare a
  huge image), and decodes completely (a truncated file is a 400, never a stage crash);
- the mask is a PNG with an alpha channel of the first image's size (OpenAI's rule).

Each image is converted to RGB (EXIF rotation applied) and re-encoded as a lossless PNG, the
form the stages receive (`GenerationParams.input_images`); the mask becomes an "L" PNG, 255
where its alpha is 0 (OpenAI: fully transparent = the area to edit).

Form fields: `image` (one file) or `image[]` (several, as the openai client sends a list),
`prompt`, `mask`, `model`, `n`, `size`, `response_format`, `output_format`,
`output_compression`, `stream`, `partial_images`, `user`, and our extensions `seed`,
`num_inference_steps`, `guidance_scale`, `negative_prompt`, the family's knobs, `cache` (step
caching: a JSON object, or `cache[policy]`, `cache[threshold]`, ... as the openai client writes a
nested `extra_body` mapping into a form), and `url` / `url[]` (source images by URL:
serving/edit_urls.py). `size` omitted or "auto": the first image's aspect ratio at the stage's
default area (`auto_size`). A file under any other name is a 400; so is any text field the route
or the model's family does not apply (serving/request_fields.py), as on the generations route.
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from . import cache_field, lora_adapters
from .errors import APIError, invalid
from .protocol import ImageLimits, ValidRequest
from .request_fields import EDITS
from .validation import validate_request

MAX_EDIT_BODY_BYTES = 64 << 20
MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES = 16  # OpenAI's limit for one edit; a pipeline's topology may allow fewer
FORMATS = ("PNG", "JPEG", "WEBP")
IMAGE_FIELDS = ("image", "image[]")
FILE_FIELDS = (*IMAGE_FIELDS, "mask")
URL_FIELDS = ("url", "url[]")
INT_FIELDS = ("n", "seed", "num_inference_steps", "partial_images", "output_compression")
# The knobs of every family are numbers (diffusion/knobs.py); a non-numeric one is refused.
FLOAT_FIELDS = (
    "guidance_scale",
    "true_cfg_scale",
    "guidance_scale_2",
    "boundary_ratio",
    "flow_shift",
)
BOOL_FIELDS = ("stream", "progress_events")


def _is_file(value: Any) -> bool:
    return hasattr(value, "filename") and hasattr(value, "read")


def form_fields(items: list[tuple[str, Any]]) -> tuple[dict[str, Any], list[Any], Any]:
    """(typed text fields, image uploads in order, mask upload or None) of a parsed form."""
    data: dict[str, Any] = {}
    images: list[Any] = []
    mask = None
    for name, value in items:
        if _is_file(value):
            if name in IMAGE_FIELDS:
                images.append(value)
            elif name == "mask":
                if mask is not None:
                    raise invalid("send at most one mask", "mask")
                mask = value
            else:
                raise invalid(
                    f"unknown file parameter '{name}': send source images as 'image' "
                    "(or 'image[]' for several) and the mask as 'mask'",
                    name,
                    "unknown_parameter",
                )
            continue
        if name in FILE_FIELDS:
            raise invalid(f"'{name}' must be a file upload, not text", name, "invalid_type")
        if name in URL_FIELDS:  # source images by URL, in order, under one name
            data.setdefault("url", []).append(value)
            continue
        if lora_adapters.fold_form_field(data, name, value):
            continue
        key = cache_field.form_key(name)
        if key is not None:
            cache = data.setdefault("cache", {})
            if not isinstance(cache, dict) or key in cache:
                raise invalid(f"parameter '{name}' is given twice", "cache", "invalid_value")
            cache[key] = cache_field.form_value(key, value)
            continue
        if name in data:
            raise invalid(f"parameter '{name}' is given twice", name, "invalid_value")
        data[name] = _typed(name, value)
    lora_adapters.finish_form_fields(data)
    return data, images, mask


def _typed(name: str, value: str) -> Any:
    """Multipart fields are text; type them as the JSON route's strict model expects."""
    try:
        if name in INT_FIELDS:
            return int(value)
        if name in FLOAT_FIELDS:
            return float(value)
    except ValueError:
        kind = "an integer" if name in INT_FIELDS else "a number"
        raise invalid(
            f"invalid type for '{name}': expected {kind}, got {value!r}", name, "invalid_type"
        ) from None
    if name == "cache":  # a JSON object in one text field
        return cache_field.json_value(value)
    if name in BOOL_FIELDS:
        if value.lower() not in ("true", "false"):
            raise invalid(
                f"invalid type for '{name}': expected true or false", name, "invalid_type"
            )
        return value.lower() == "true"
    return value


def check_topology(topology: Any, images: list[Any], mask: Any) -> None:
    """Whether this pipeline takes these uploads at all (before any file is read)."""
    most = min(topology.max_input_images, MAX_IMAGES)
    if most == 0:
        raise invalid(
            f"the {topology.key} pipeline generates from text only; "
            "use POST /v1/images/generations",
            "image",
            "unsupported_endpoint",
        )
    if not images:
        raise invalid("missing required parameter 'image'", "image", "missing_required_parameter")
    if len(images) > most:
        raise invalid(
            f"{len(images)} images sent; the {topology.key} pipeline takes at most {most}",
            "image",
            "too_many_images",
        )
    if mask is not None and not topology.accepts_mask:
        raise invalid(
            f"the {topology.key} pipeline does not inpaint: 'mask' is not supported",
            "mask",
            "unsupported_parameter",
        )


def open_checked(data: bytes, param: str, formats: tuple[str, ...] = FORMATS) -> Image.Image:
    """A fully decoded image from upload bytes, or a 400 naming `param`.

    The pixel count is read from the header before decoding (decompression-bomb guard)."""
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(
            413,
            f"'{param}' is larger than {MAX_IMAGE_BYTES} bytes",
            param=param,
            code="file_too_large",
        )
    if not data:
        raise invalid(f"'{param}' is an empty file", param, "invalid_image")
    try:
        with warnings.catch_warnings():
            # We bound the pixel count ourselves, just below, with a clear 400.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError:  # PIL's own guard: over twice its pixel limit
        raise _too_large(param, "more than twice PIL's pixel limit") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise invalid(
            f"'{param}' is not a valid image; send {', '.join(f.lower() for f in formats)}",
            param,
            "invalid_image_format",
        ) from None
    width, height = im.size
    if width * height > MAX_IMAGE_PIXELS:
        raise _too_large(param, f"{width}x{height} pixels")
    try:
        im.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise invalid(
            f"'{param}' could not be decoded (truncated or corrupt file)", param, "invalid_image"
        ) from None
    return im


def _too_large(param: str, what: str) -> APIError:
    return invalid(
        f"'{param}' is {what}; the limit is {MAX_IMAGE_PIXELS} pixels", param, "image_too_large"
    )


def to_rgb_png(im: Image.Image) -> bytes:
    """The stages' form of a source image: RGB, EXIF rotation applied, lossless PNG, and no
    metadata: an embedded ICC profile (which can be megabytes, more than the stage's PNG reader
    accepts) or text chunks are not carried over."""
    rgb = ImageOps.exif_transpose(im).convert("RGB")
    rgb.info.clear()  # the PNG writer would copy the ICC profile and other metadata from here
    out = io.BytesIO()
    rgb.save(out, format="PNG", compress_level=1)  # lossless; level 1: fast to encode
    return out.getvalue()


def mask_png(mask: Image.Image, size: tuple[int, int]) -> bytes:
    """OpenAI's mask (alpha 0 = edit here) as an "L" PNG, 255 = repaint."""
    if mask.format != "PNG" or "A" not in mask.getbands():
        raise invalid("'mask' must be a PNG with an alpha channel", "mask", "invalid_mask")
    if mask.size != size:
        raise invalid(
            f"'mask' is {mask.size[0]}x{mask.size[1]}; it must have the first image's size "
            f"{size[0]}x{size[1]}",
            "mask",
            "invalid_mask",
        )
    alpha = mask.getchannel("A")
    out = io.BytesIO()
    alpha.point(lambda a: 255 if a == 0 else 0).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def decode_uploads(
    images: list[bytes],
    mask: bytes | None,
    max_aspect_ratio: float | None = None,
    min_side: int | None = None,
) -> tuple[list[bytes], bytes | None]:
    """Check and convert the uploads (CPU work: the caller runs it off the event loop)."""
    params = ["image" if len(images) == 1 else f"image[{i}]" for i in range(len(images))]
    opened = [open_checked(data, param) for data, param in zip(images, params, strict=True)]
    for im, param in zip(opened, params, strict=True):
        w, h = im.size
        if max_aspect_ratio is not None and max(w, h) > max_aspect_ratio * min(w, h):
            raise invalid(
                f"'{param}' is {w}x{h}: this pipeline takes source images with an aspect "
                f"ratio of at most {max_aspect_ratio:g}",
                param,
                "invalid_image_size",
            )
        if min_side is not None and min(w, h) < min_side:
            raise invalid(
                f"'{param}' is {w}x{h}: this pipeline takes source images of at least "
                f"{min_side} pixels on each side",
                param,
                "invalid_image_size",
            )
    out_mask = None
    if mask is not None:
        out_mask = mask_png(open_checked(mask, "mask", ("PNG",)), opened[0].size)
    return [to_rgb_png(im) for im in opened], out_mask


def edit_request(data: dict[str, Any], limits: ImageLimits) -> ValidRequest:
    """The text fields checked exactly as on the generations route (same bounds and errors)."""
    if "prompt" not in data:
        raise invalid("missing required parameter 'prompt'", "prompt", "missing_required_parameter")
    return validate_request(data, limits, EDITS)


def auto_size(image_size: tuple[int, int], limits: ImageLimits) -> tuple[int, int]:
    """(width, height) of an edit whose `size` is omitted or "auto": the first source image's
    aspect ratio at the stage's default area (diffusers' edit pipelines size their output from
    the input the same way), on the stage's size grid and inside its bounds."""
    lim = limits.stage
    g = lim.granularity
    w, h = image_size
    area = lim.default_width * lim.default_height
    out = []
    for side, low, top in (
        (math.sqrt(area * w / h), lim.min_width, lim.max_width),
        (math.sqrt(area * h / w), lim.min_height, lim.max_height),
    ):
        lo, hi = -(-low // g) * g, top // g * g  # the grid's first and last sizes in bounds
        out.append(min(max(round(side / g) * g, lo), hi))
    return out[0], out[1]


def with_uploads(
    valid: ValidRequest, images: list[bytes], mask: bytes | None, size: tuple[int, int] | None
) -> ValidRequest:
    """`valid` carrying its uploads; `size`: (width, height) replacing an "auto" size."""
    width, height = size or (valid.width, valid.height)
    return dataclasses.replace(
        valid,
        input_images=tuple(images),
        mask=mask,
        event_prefix="image_edit",
        width=width,
        height=height,
    )
