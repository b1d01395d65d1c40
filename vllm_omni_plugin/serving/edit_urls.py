"""Media given by URL: an edit's source images (`url` / `url[]` form fields), a video job's
`input_reference`, a chat request's image, audio and video parts.

A `data:` URL is always taken (its bytes are the upload). An http(s) URL is fetched only when
its host is in the deploy file's `serving.edit_url_hosts` (empty by default: the server never
fetches what a client points it at unless an operator chose the hosts); no redirects are
followed, the whole fetch has a deadline and stops at the route's byte limit. Whatever arrives
is then checked exactly like an upload (serving/edits.py, serving/media_limits.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.parse
from collections.abc import Callable

import httpx

from .errors import APIError, invalid

# The whole fetch, from connecting to the last byte: a server that sends slowly is cut off too.
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


async def fetch_url(
    url: str,
    param: str,
    hosts: tuple[str, ...],
    limit: int,
    *,
    kind: str = "image",
    inline: str = "as a file or a data: URL",
    too_large: Callable[[int], APIError] | None = None,
) -> bytes:
    """The bytes behind a URL (data:, or http(s) on a listed host), or a 4xx naming `param`.
    `kind` names what is fetched and `inline` how a client can send it instead; past `limit`
    bytes of an http(s) answer, `too_large(limit)` (a 413 naming `param` by default)."""
    refuse_size = too_large or (lambda n: _too_large(param, n))
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
            f"'{param}': this server does not fetch {kind} URLs from {parsed.hostname!r}; send it "
            f"{inline} (operators list hosts in serving.edit_url_hosts)",
            param,
            "url_not_allowed",
        )
    try:
        return await asyncio.wait_for(_get(url, param, kind, limit, refuse_size), FETCH_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise invalid(
            f"'{param}': the {kind} did not arrive within {FETCH_TIMEOUT_S:g} s",
            param,
            "url_fetch_failed",
        ) from None
    except httpx.HTTPError as exc:
        raise invalid(
            f"'{param}': the {kind} could not be fetched ({type(exc).__name__})",
            param,
            "url_fetch_failed",
        ) from None


async def _get(
    url: str, param: str, kind: str, limit: int, too_large: Callable[[int], APIError]
) -> bytes:
    async with (
        httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False) as client,
        client.stream("GET", url) as response,
    ):
        if response.status_code != 200:
            raise invalid(
                f"'{param}': fetching the {kind} answered HTTP {response.status_code}",
                param,
                "url_fetch_failed",
            )
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    return b"".join(chunks)
