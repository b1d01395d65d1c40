"""Checks of the file's sections: stage lists, the legacy graph, `platforms:`, `serving:`."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from vllm_omni_plugin.config.errors import ProblemSink, did_you_mean
from vllm_omni_plugin.config.owners_common import ServingLimits
from vllm_omni_plugin.config.stage_keys import flatten_stage, route
from vllm_omni_plugin.pipelines import PipelineTopology, validate_graph

PLATFORMS = ("cuda", "rocm", "npu", "xpu", "musa", "cpu", "tpu")


def stage_entries(data: dict[str, Any], sink: ProblemSink) -> dict[int, dict[str, Any]]:
    raw = data.get("stages")
    if raw is None:
        return {}
    if not isinstance(raw, list):
        sink.add(
            None,
            "stages",
            f"must be a list of stages (`- stage_id: 0 ...`), got {type(raw).__name__}",
        )
        return {}
    out: dict[int, dict[str, Any]] = {}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            sink.add(None, f"stages[{i}]", "each stage must be a mapping with a stage_id")
            continue
        sid = entry.get("stage_id")
        if isinstance(sid, str) and sid.strip().isdigit():
            sid = int(sid)
        if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
            sink.add(None, f"stages[{i}].stage_id", f"must be a non-negative integer, got {sid!r}")
            continue
        if sid in out:
            sink.add(sid, "stage_id", f"duplicate stage_id {sid} (each stage is listed once)")
            continue
        out[sid] = flatten_stage({k: v for k, v in entry.items() if k != "stage_id"}, sid, sink)
    return out


def check_declared_graph(
    topo: PipelineTopology,
    stage_lists: list[tuple[str, dict[int, dict[str, Any]]]],
    sink: ProblemSink,
) -> None:
    """A legacy file's own graph (`engine_input_source`, `final_output`) must be sound and
    match the frozen topology; when it does, it is redundant and ignored."""
    declared: dict[int, Any] = {}
    finals: dict[int, Any] = {}
    ids = set(topo.stage_ids)
    for _, entries in stage_lists:
        for sid, flat in entries.items():
            ids.add(sid)
            if "engine_input_source" in flat:
                declared[sid] = flat["engine_input_source"]
            if "final_output" in flat:
                finals[sid] = flat["final_output"]
    if not declared:
        return
    graph: dict[int, list[int]] = {}
    for sid in sorted(ids):
        src = declared.get(sid, topo.stage(sid).inputs if sid in topo.stage_ids else [])
        src = [] if src is None else ([src] if isinstance(src, int) else src)
        if not isinstance(src, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in src
        ):
            sink.add(sid, "engine_input_source", f"must be a list of stage ids, got {src!r}")
            src = []
        graph[sid] = src
    final_ids = [sid for sid, flag in finals.items() if flag] if finals else None
    problems = validate_graph(graph, final_ids)
    for message in problems:
        sink.add(None, "engine_input_source", message)
    if problems:
        return
    for sid in sorted(declared):
        if sid in topo.stage_ids and sorted(graph[sid]) != sorted(topo.stage(sid).inputs):
            sink.add(
                sid,
                "engine_input_source",
                f"{graph[sid]} contradicts pipeline {topo.key!r}, where stage {sid} takes input "
                f"from {topo.stage(sid).inputs or 'nothing (entry stage)'}; remove engine_input_source",
            )


def platform_entries(
    raw: Any, platform: str, topo: PipelineTopology, sink: ProblemSink
) -> dict[int, dict[str, Any]]:
    """Check every platform section's shape; return the stages of the one that applies."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        sink.add(None, "platforms", "must be a mapping {cuda: {stages: [...]}, npu: ...}")
        return {}
    chosen: dict[int, dict[str, Any]] = {}
    for name, section in raw.items():
        if name not in PLATFORMS:
            sink.add(
                None, f"platforms.{name}", "unknown platform" + did_you_mean(str(name), PLATFORMS)
            )
            continue
        if section is None:
            continue
        if not isinstance(section, dict) or not isinstance(section.get("stages", []), list):
            sink.add(None, f"platforms.{name}", "must be a mapping with a `stages` list")
            continue
        for key in sorted(set(section) - {"stages", "model_runner"}):
            sink.add(None, f"platforms.{name}.{key}", "unknown key" + did_you_mean(key, ["stages"]))
        entries = stage_entries(section, sink)
        for sid, flat in entries.items():
            if sid not in topo.stage_ids:
                sink.add(sid, f"platforms.{name}", f"pipeline {topo.key!r} has no stage {sid}")
            for key in flat:
                if route(key, topo.stage(sid).kind if sid in topo.stage_ids else "ar") == "unknown":
                    sink.add(sid, f"platforms.{name}.{key}", "unknown key" + did_you_mean(key, []))
        if name == platform:
            chosen = entries
    return chosen


def serving_limits(raw: Any, sink: ProblemSink) -> ServingLimits:
    if raw is None:
        return ServingLimits()
    if not isinstance(raw, dict):
        sink.add(None, "serving", "must be a mapping (max_n, max_prompt_chars, ...)")
        return ServingLimits()
    try:
        return ServingLimits(**raw)
    except ValidationError as exc:
        for err in exc.errors():
            key = ".".join(map(str, err["loc"]))
            msg = (
                "unknown key" + did_you_mean(key, ServingLimits.model_fields)
                if err["type"] == "extra_forbidden"
                else err["msg"]
            )
            sink.add(None, f"serving.{key}", msg)
        return ServingLimits()
