"""Request bodies read with a byte limit, as they arrive (declared length or chunked).

Every route the plugin adds reads its body through here, so no route buffers more than its
limit: the bytes are counted chunk by chunk and the read stops with a 413 the moment the count
passes the limit (the rest of the body is never read; the server closes the connection after
answering). Multipart forms are parsed from the same counted stream, so an upload is spooled
(memory up to 1 MiB per file, then a temporary file) only up to the route's limit. A route that
takes no body (GET, DELETE) refuses one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from starlette.datastructures import FormData
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

from .errors import APIError, invalid


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")


async def counted(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks; APIError 413 as soon as more than `limit` bytes arrived (or were
    declared in Content-Length), before the chunk past the limit is kept anywhere."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        if chunk:
            yield chunk


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, at most `limit` bytes (413 past it)."""
    return b"".join([chunk async for chunk in counted(request, limit)])


async def refuse_body(request: Request) -> None:
    """For routes without a body: a request that sends one gets 413 (limit 0)."""
    declared = request.headers.get("content-length")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    if chunked or (declared is not None and declared.strip() not in ("", "0")):
        raise APIError(
            413, f"{request.method} {request.url.path} takes no request body", code="body_too_large"
        )


async def read_form(
    request: Request,
    limit: int,
    *,
    max_files: int,
    max_fields: int,
    max_part_size: int = 1 << 20,
) -> FormData:
    """A multipart or urlencoded form parsed while its body is counted: 413 past `limit` bytes in
    all (so every part too), 400 for a malformed form. Text fields are at most `max_part_size`
    bytes each. The caller closes the form (its uploads may be temporary files)."""
    content_type = request.headers.get("content-type", "")
    stream = counted(request, limit)
    try:
        if content_type.startswith("multipart/form-data"):
            parser = MultiPartParser(
                request.headers,
                stream,
                max_files=max_files,
                max_fields=max_fields,
                max_part_size=max_part_size,
            )
            return await parser.parse()
        if content_type.startswith("application/x-www-form-urlencoded"):
            form = await FormParser(request.headers, stream).parse()
            if len(form) > max_fields:
                raise invalid(f"more than {max_fields} form fields", None, "invalid_multipart")
            return form
    except MultiPartException as exc:
        raise invalid(
            f"malformed multipart body: {exc.message}", None, "invalid_multipart"
        ) from None
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise invalid(f"malformed form body: {exc}", None, "invalid_multipart") from None
    raise invalid(
        "expected multipart/form-data or application/x-www-form-urlencoded",
        None,
        "invalid_content_type",
    )
