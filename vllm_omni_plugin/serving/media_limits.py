"""Bounds on the image, audio and video parts of a chat request, checked before vLLM or any
stage sees the request (text answers and speech answers alike).

Each refusal is an APIError 400 in OpenAI's shape whose `param` is the part's path
(`messages[0].content[1]`) and whose message names the `serving:` setting:

- more media parts than `serving.max_media_parts` (all messages together);
- a base64 part (`input_audio` data, a `data:` URL) whose decoded size exceeds
  `serving.max_media_part_bytes`, told from the base64 length before anything is decoded;
- an image wider x taller than `serving.max_input_image_pixels` (read from its header only);
- audio longer than `serving.max_input_audio_s` (decoded, as the length is not in every header);
- a video with more frames than `serving.max_input_video_frames`, or frames of more pixels than
  `serving.max_input_image_pixels` (both read from its container);
- a part that is not base64, or not an image / audio / video of the kind its part says;
- an http(s) URL whose host is not in `serving.edit_url_hosts` (none by default), as for edits,
  or a `file:` URL outside the chat stage's `allowed_local_media_path`.

An http(s) URL on a listed host is fetched here as an edit's source image is (edit_urls.py: no
redirects, one deadline, at most `serving.max_media_part_bytes`); a failed fetch is a 400. A
`file:` URL is read here from within the chat stage's `allowed_local_media_path` (vLLM's
setting; without it, or outside it, a 400). Either part then carries what was read as a data:
URL, held to the same bounds as one sent so, and vLLM's media handling reads nothing itself.
Embedding parts (`image_embeds`, ...) are counted and sized, not decoded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .edit_urls import fetch_url
from .errors import APIError, invalid

# Content part type (or, in vLLM's shorthand without a type, its key) -> media kind.
PART_KINDS = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
_DECODED = ("image_url", "input_image", "input_audio", "audio_url", "video_url")
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)


@dataclass(frozen=True)
class MediaPart:
    path: str  # messages[i].content[j]
    part_type: str
    kind: str  # image / audio / video
    payload: Any  # the base64 text to decode, or None (a URL, embeddings, PIL object)
    url: str | None = None  # a URL other than data: (http(s) and file: are read here)
    part: dict = field(default_factory=dict, compare=False, repr=False)  # the content part


@dataclass(frozen=True)
class MediaLimits:
    max_media_parts: int
    max_media_part_bytes: int
    max_input_image_pixels: int
    max_input_audio_s: float
    max_input_video_frames: int
    url_hosts: tuple[str, ...] = ()
    local_media: Path | None = None  # the chat stage's allowed_local_media_path, resolved

    @classmethod
    def from_serving(cls, serving: Any, local_media: str | None = None) -> MediaLimits:
        return cls(
            max_media_parts=int(serving.max_media_parts),
            max_media_part_bytes=int(serving.max_media_part_bytes),
            max_input_image_pixels=int(serving.max_input_image_pixels),
            max_input_audio_s=float(serving.max_input_audio_s),
            max_input_video_frames=int(serving.max_input_video_frames),
            url_hosts=tuple(serving.edit_url_hosts),
            local_media=Path(local_media).resolve() if local_media else None,
        )

    @property
    def max_body_bytes(self) -> int:
        """The largest legal chat body: every media part at its byte bound, base64-encoded
        (4 bytes per 3), plus MAX_BODY_BYTES of text and JSON around them."""
        from .validation import MAX_BODY_BYTES

        part = -(-self.max_media_part_bytes // 3) * 4
        return self.max_media_parts * part + MAX_BODY_BYTES

    async def check(self, messages: Any) -> None:
        """APIError 400 for the first part out of bounds (see the module docstring). Counting
        and sizing run here, then the reads of http(s) and file: parts (each part's URL becomes
        the data: URL of what was read); decoding runs in a worker thread, off the event loop."""
        parts = self.sized_parts(messages)
        by_url = [p for p in parts if _scheme(p.url) in ("http", "https", "file")]
        if by_url:
            read = dict(zip(map(id, by_url), await self._read_all(by_url), strict=True))
            parts = [read.get(id(p), p) for p in parts]
        if any(_decodes(p) for p in parts):
            await asyncio.to_thread(self.measure, parts)

    async def _read_all(self, parts: list[MediaPart]) -> list[MediaPart]:
        """Every URL part read, concurrently; the first refusal cancels the others."""
        tasks = [asyncio.ensure_future(self._read(p)) for p in parts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _read(self, part: MediaPart) -> MediaPart:
        """The part with its URL's bytes in its place, as a data: URL."""
        if _scheme(part.url) == "file":
            raw = await asyncio.to_thread(self._read_file, part)
        else:
            raw = await fetch_url(
                part.url,
                part.path,
                self.url_hosts,
                self.max_media_part_bytes,
                kind=part.kind,
                inline="as a data: URL",
                too_large=lambda limit: self._too_large(part, f"more than {limit}"),
            )
        url = "data:application/octet-stream;base64," + base64.b64encode(raw).decode()
        _set_url(part.part, part.part_type, url)
        return replace(part, payload=url, url=None)

    def _read_file(self, part: MediaPart) -> bytes:
        """A file: URL's bytes, from within `local_media` only (as vLLM's own reader allows)."""
        root = self.local_media
        path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(part.url).path)).resolve()
        if root is None or root not in path.parents:
            where = "no local files" if root is None else "local files only from its media folder"
            raise invalid(
                f"{part.path}: this server reads {where}; send the {part.kind} as a data: URL "
                "(operators choose the folder with the chat stage's allowed_local_media_path)",
                part.path,
                "url_not_allowed",
            )
        try:
            with path.open("rb") as f:
                raw = f.read(self.max_media_part_bytes + 1)
        except OSError as exc:
            raise invalid(
                f"{part.path}: the file cannot be read ({type(exc).__name__})",
                part.path,
                "url_fetch_failed",
            ) from None
        if len(raw) > self.max_media_part_bytes:
            raise self._too_large(part, f"more than {self.max_media_part_bytes}")
        return raw

    def _too_large(self, part: MediaPart, size: str) -> APIError:
        return invalid(
            f"{part.path}: this {part.kind} part is {size} bytes; this server takes at most "
            f"{self.max_media_part_bytes} bytes per part (serving.max_media_part_bytes)",
            part.path,
            "media_part_too_large",
        )

    def sized_parts(self, messages: Any) -> list[MediaPart]:
        """The media parts, after the count and byte bounds (no decoding)."""
        parts = media_parts(messages)
        if len(parts) > self.max_media_parts:
            raise invalid(
                f"{parts[self.max_media_parts].path}: this request carries {len(parts)} image, "
                f"audio or video parts; this server takes at most {self.max_media_parts} "
                "(serving.max_media_parts)",
                parts[self.max_media_parts].path,
                "too_many_media_parts",
            )
        for part in parts:
            if _unreadable_url(part):
                raise invalid(
                    f"{part.path}: the {part.part_type} part needs its {part.kind} as a data: "
                    "URL, an http(s) URL or a file: URL",
                    part.path,
                    f"invalid_{part.kind}",
                )
            text = part.payload if isinstance(part.payload, str) else None
            if text is None:
                continue
            size = base64_decoded_size(text)
            if size > self.max_media_part_bytes:
                raise self._too_large(part, f"{size}")
        return parts

    def measure(self, parts: list[MediaPart]) -> None:
        """Decode what must be decoded (bounded by the byte check before) and check its size."""
        for part in parts:
            if not _decodes(part):
                continue
            raw = _b64decode(part)
            if part.kind == "image":
                self._check_image(part, raw)
            elif part.kind == "audio":
                self._check_audio(part, raw)
            else:
                self._check_video(part, raw)

    def _check_image(self, part: MediaPart, raw: bytes) -> None:
        from PIL import Image

        try:
            # Opening reads the header only; the pixels are decoded later, by vLLM.
            with Image.open(io.BytesIO(raw)) as image:
                width, height = image.size
            size = f"{width}x{height} = {width * height} pixels"
            too_large = width * height > self.max_input_image_pixels
        except Image.DecompressionBombError:  # beyond PIL's own bound, so beyond vLLM's loader
            size, too_large = "more pixels than PIL opens", True
        except Exception:
            raise undecodable(part) from None
        if too_large:
            raise invalid(
                f"{part.path}: the image is {size}; this server takes at most "
                f"{self.max_input_image_pixels} (serving.max_input_image_pixels)",
                part.path,
                "image_too_large",
            )

    def _check_audio(self, part: MediaPart, raw: bytes) -> None:
        try:
            seconds = decoded_seconds(raw)
        except Exception:
            raise undecodable(part) from None
        if seconds > self.max_input_audio_s:
            raise invalid(
                f"{part.path}: the audio lasts {seconds:.1f} s; this server takes at most "
                f"{self.max_input_audio_s:g} s (serving.max_input_audio_s)",
                part.path,
                "audio_too_long",
            )

    def _check_video(self, part: MediaPart, raw: bytes) -> None:
        try:
            frames, width, height = container_video(raw)
        except ImportError:
            return  # without PyAV the frame count is not knowable here; vLLM's loader bounds it
        except Exception:
            raise undecodable(part) from None
        if frames > self.max_input_video_frames:
            raise invalid(
                f"{part.path}: the video holds {frames} frames; this server takes at most "
                f"{self.max_input_video_frames} (serving.max_input_video_frames)",
                part.path,
                "video_too_long",
            )
        if width * height > self.max_input_image_pixels:
            raise invalid(
                f"{part.path}: the video's frames are {width}x{height} = {width * height} "
                f"pixels; this server takes at most {self.max_input_image_pixels} per frame "
                "(serving.max_input_image_pixels)",
                part.path,
                "video_too_large",
            )


def undecodable(part: MediaPart) -> APIError:
    return invalid(
        f"{part.path}: the {part.part_type} part is not {_ARTICLE[part.kind]} this server can "
        "decode",
        part.path,
        f"invalid_{part.kind}",
    )


_ARTICLE = {"image": "an image", "audio": "audio", "video": "a video"}


def media_parts(messages: Any) -> list[MediaPart]:
    """Every image, audio and video part of the messages, in order."""
    out = []
    for i, message in enumerate(messages or []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            part_type = part.get("type")
            if part_type is None:  # vLLM's shorthand: the part's key says its type
                part_type = next((key for key in PART_KINDS if key in part), None)
            if part_type not in PART_KINDS:
                continue
            path = f"messages[{i}].content[{j}]"
            payload = _payload(part, part_type)
            url = _url(part, part_type) if payload is None else None
            out.append(MediaPart(path, part_type, PART_KINDS[part_type], payload, url, part))
    return out


def _url_holder(part: dict[str, Any], part_type: str) -> tuple[dict[str, Any], str]:
    """(mapping, key) where a URL part keeps its URL: `{"url": ...}` under the part's key, or
    the part's key itself in vLLM's shorthand (`{"image_url": "https://..."}`)."""
    key = "image_url" if part_type == "input_image" else part_type
    value = part.get(key)
    return (value, "url") if isinstance(value, dict) else (part, key)


def _scheme(url: str | None) -> str:
    return urllib.parse.urlsplit(url).scheme.lower() if url else ""


def _unreadable_url(part: MediaPart) -> bool:
    """A URL part with no URL, or one of a scheme nothing reads. A part that names a `uuid`
    may leave its URL out (vLLM then takes the item from its cache by that id)."""
    return (
        part.part_type in _DECODED
        and part.payload is None
        and _scheme(part.url) not in ("http", "https", "file")
        and part.part.get("uuid") is None
    )


def _url(part: dict[str, Any], part_type: str) -> str | None:
    """The URL a URL part names (None for other parts)."""
    if part_type not in _DECODED or part_type == "input_audio":
        return None
    holder, key = _url_holder(part, part_type)
    url = holder.get(key)
    return url if isinstance(url, str) else None


def _set_url(part: dict[str, Any], part_type: str, url: str) -> None:
    holder, key = _url_holder(part, part_type)
    holder[key] = url


def _payload(part: dict[str, Any], part_type: str) -> Any:
    """The base64 text of a part to decode; None when it is fetched or given by other means."""
    value = part.get(part_type)
    if part_type == "input_audio":
        data = value.get("data") if isinstance(value, dict) else None
        return data if isinstance(data, str) else ""
    if part_type == "input_image":
        value = part.get("image_url")
    if part_type not in _DECODED:
        # Embeddings: sized as base64 text when they are text, never decoded here.
        return _Sized(value) if isinstance(value, str) else None
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url[:5].lower() == "data:":
        return None  # a URL: fetched in `check` (http, https) or left to vLLM (file)
    return url


class _Sized(str):
    """Base64 text that counts against the byte bound but is not decoded here."""


def base64_decoded_size(text: str) -> int:
    """Bytes the base64 text (or a data URL's) decodes to, from its length alone."""
    match = _DATA_URL.match(text)
    body = text[match.end() :] if match else text
    body = body.rstrip("=\n\r ")
    return len(body) * 3 // 4


def _decodes(part: MediaPart) -> bool:
    return isinstance(part.payload, str) and not isinstance(part.payload, _Sized)


def _b64decode(part: MediaPart) -> bytes:
    text = part.payload
    if part.part_type != "input_audio":
        match = _DATA_URL.match(text)
        if match is None or "base64" not in match.group(2).lower().split(";"):
            raise invalid(
                f"{part.path}: a data URL must be base64 (data:<type>;base64,<data>)",
                part.path,
                f"invalid_{part.kind}",
            )
        text = text[match.end() :]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if not raw:
        raise invalid(
            f"{part.path}: the {part.part_type} data is not base64",
            part.path,
            f"invalid_{part.kind}",
        )
    return raw


def container_video(raw: bytes) -> tuple[int, int, int]:
    """(frames, width, height) of the first video stream: the frame count from the container's
    header, else by counting its packets (demuxed, not decoded). ImportError without PyAV."""
    import av

    with av.open(io.BytesIO(raw)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        size = int(stream.codec_context.width), int(stream.codec_context.height)
        if stream.frames:
            return int(stream.frames), *size
        return sum(1 for packet in container.demux(stream) if packet.size), *size


def decoded_seconds(raw: bytes) -> float:
    """Length of an encoded audio file, by decoding it (FFmpeg through PyAV)."""
    import av

    with av.open(io.BytesIO(raw)) as container:
        if not container.streams.audio:
            raise ValueError("no audio stream")
        stream = container.streams.audio[0]
        samples = 0
        rate = None
        for frame in container.decode(stream):
            samples += frame.samples
            rate = frame.sample_rate
    if not samples or not rate:
        raise ValueError("no audio samples")
    return samples / rate
