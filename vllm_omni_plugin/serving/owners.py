"""Who owns a video job or a `response_format=url` file: the API key that created it.

When the server has keys (`--api-key` or `VLLM_API_KEY`, which vLLM's middleware checks on every
/v1 route before ours run), a job or file is visible only to requests bearing the same key: any
other key gets 404, as if it did not exist. The owner is kept as a SHA-256 digest of the key,
never the key itself. Without keys there is no owner (None) and everything is shared.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from fastapi import Request


def server_has_keys(args: Any) -> bool:
    """The same rule vLLM applies when it installs its key check (--api-key before the env)."""
    keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]
    return any(keys)


def owner_of(request: Request) -> str | None:
    """The digest of the request's bearer key when the server has keys; otherwise None."""
    if not server_has_keys(getattr(request.app.state, "args", None)):
        return None
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        return None  # cannot happen past vLLM's check; owns nothing
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def visible(owner: str | None, requester: str | None) -> bool:
    """Whether a thing owned by `owner` is visible to `requester`: always on a server without
    keys (requester None); with keys, only to its own key (a thing made while the server had no
    keys has no owner and is visible to no key)."""
    return requester is None or owner == requester
