"""Source images of an edit given by URL (`url` / `url[]` form fields) instead of as files.

A `data:` URL is always taken (its bytes are the upload). An http(s) URL is fetched only when
its host is in the deploy file's `serving.edit_url_hosts` (empty by default: the server never
fetches what a client points it at unless an operator chose the hosts); no redirects are
followed, the fetch has a deadline and stops at the upload byte limit. Whatever arrives is then
checked exactly like an uploaded file (serving/edits.py).
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse

import httpx

from .errors import APIError, invalid

FETCH_TIMEOUT_S = 10.0


def _too_large(param: str, limit: int) -> APIError:
    return APIError(
        413, f"'{param}' is larger than {limit} bytes", param=param, code="file_too_large"
    )


def decode_data_url(url: str, param: str, limit: int) -> bytes:
    """The bytes of a `data:[<media type>][;base64],<data>` URL."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise invalid(f"'{param}' is not a valid data: URL (no comma)", param, "invalid_url")
    if len(payload) > limit * 4 // 3 + 4:
        raise _too_large(param, limit)
    if head.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(f"'{param}' has invalid base64 data", param, "invalid_url") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > limit:
        raise _too_large(param, limit)
    return data


async def fetch_url(url: str, param: str, hosts: tuple[str, ...], limit: int) -> bytes:
    """The bytes behind a source image URL (data:, or http(s) on a listed host), or a 4xx."""
    if url[:5].lower() == "data:":
        return decode_data_url(url[5:], param, limit)
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise invalid(
            f"'{param}' must be a data: URL (or an http(s) URL on a host the server lists)",
            param,
            "invalid_url",
        )
    if parsed.hostname.lower() not in hosts:
        raise invalid(
            f"'{param}': this server does not fetch images from {parsed.hostname!r}; send the "
            "image as a file or a data: URL (operators list hosts in serving.edit_url_hosts)",
            param,
            "url_not_allowed",
        )
    try:
        async with (
            httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise invalid(
                    f"'{param}': fetching the image answered HTTP {response.status_code}",
                    param,
                    "url_fetch_failed",
                )
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise _too_large(param, limit)
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise invalid(
            f"'{param}': the image could not be fetched ({type(exc).__name__})",
            param,
            "url_fetch_failed",
        ) from None
    return b"".join(chunks)
