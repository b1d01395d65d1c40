"""The `cache` request field (step caching) on every image and video route, in one place.

JSON bodies carry it as an object (`extra_body={"cache": {"policy": "first_block",
"threshold": 0.1}}`); multipart forms (edits, videos from the openai client) as `cache[policy]`,
`cache[threshold]`, ... text fields, or one `cache` field holding a JSON object. The syntax and
the hard bounds are checked here (400 naming e.g. `cache.threshold`); whether the stage enables
the policy, and its `max_threshold`, the diffusion stage checks against its `step_cache`.
"""

from __future__ import annotations

import json
from typing import Any

from ..common.cache_policy import CachePolicyError, parse_cache
from .errors import invalid


def form_key(name: str) -> str | None:
    """`cache[threshold]` -> "threshold" (a nested mapping written into a form); else None."""
    if name.startswith("cache[") and name.endswith("]") and len(name) > 7:
        return name[6:-1]
    return None


def form_value(key: str, text: str) -> Any:
    """A `cache[key]` form value typed: the policy name as text, numbers as numbers."""
    if key == "policy":
        return text
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    raise invalid(
        f"invalid type for 'cache.{key}': expected a number", f"cache.{key}", "invalid_type"
    )


def json_value(text: str) -> Any:
    """A `cache` form field holding a JSON object."""
    try:
        return json.loads(text)
    except ValueError:
        raise invalid("'cache' must be a JSON object", "cache", "invalid_type") from None


def fold_form(data: dict[str, Any]) -> dict[str, Any]:
    """A form's fields with its `cache[...]` fields (or JSON `cache` text) as one `cache`."""
    out: dict[str, Any] = {}
    for name, value in data.items():
        key = form_key(name)
        if key is None:
            out[name] = json_value(value) if name == "cache" and isinstance(value, str) else value
            continue
        cache = out.setdefault("cache", {})
        if not isinstance(cache, dict) or key in cache:
            raise invalid(f"parameter '{name}' is given twice", "cache", "invalid_value")
        cache[key] = form_value(key, value)
    return out


def checked(value: Any) -> dict[str, Any] | None:
    """The request's `cache` as a checked, filled mapping (None: not sent, the stage default)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(
            'cache must be an object like {"policy": "first_block"}', "cache", "invalid_type"
        )
    try:
        return parse_cache(value).as_dict()
    except CachePolicyError as exc:
        raise invalid(str(exc), exc.field) from None
