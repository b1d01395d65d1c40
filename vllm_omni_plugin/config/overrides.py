"""`--stage-overrides '{"<stage_id>": {...}}'`: parsing and checking the JSON."""

from __future__ import annotations

import json
from typing import Any

from vllm_omni_plugin.config.errors import ProblemSink


def parse_stage_overrides(raw: str | dict | None, sink: ProblemSink) -> dict[int, dict[str, Any]]:
    """Stage id -> override mapping; malformed input is reported, never raised."""
    if raw is None or raw == "" or raw == {}:
        return {}
    data: Any = raw
    if isinstance(raw, str):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            sink.add(None, "stage_overrides", f"not valid JSON ({exc.msg} at column {exc.colno})")
            return {}
    if not isinstance(data, dict):
        sink.add(None, "stage_overrides", 'must be a JSON object keyed by stage id: {"1": {...}}')
        return {}
    out: dict[int, dict[str, Any]] = {}
    for key, value in data.items():
        try:
            sid = int(key)
        except (TypeError, ValueError):
            sink.add(None, "stage_overrides", f"key {key!r} is not a stage id")
            continue
        if not isinstance(value, dict):
            sink.add(sid, "stage_overrides", "the override for a stage must be a JSON object")
            continue
        out[sid] = value
    return out
