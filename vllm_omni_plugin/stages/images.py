"""Image encoding for responses. Imports without vLLM: the diffusion stage process encodes,
the API server only reads MEDIA_TYPES (for `response_format=url`)."""

from __future__ import annotations

import io

from PIL import Image

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(image: Image.Image, fmt: str, compression: int | None = None) -> bytes:
    """PNG is lossless (what correctness checks compare); JPEG/WEBP quality = compression."""
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt in ("jpeg", "webp"):
        quality = 90 if compression is None else max(1, compression)
        image.convert("RGB").save(buf, format=fmt.upper(), quality=quality)
    else:
        raise ValueError(f"unknown output format {fmt!r}")
    return buf.getvalue()
