"""Image encoding for responses, in the diffusion stage process (the media types the API
server serves them as are common/media.py's)."""

from __future__ import annotations

import io

from PIL import Image


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
