"""Media types of what the stages encode and the API server serves (`response_format=url`)."""

from __future__ import annotations

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "mp4": "video/mp4"}
