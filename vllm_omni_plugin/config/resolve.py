"""`load_deploy_config`: file(s) -> layers -> one typed DeployConfig, or a ConfigError listing
every problem. Precedence is documented in `provenance.py`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm_omni_plugin.config import legacy
from vllm_omni_plugin.config.auto_config import AUTO, auto_config_name
from vllm_omni_plugin.config.connectors_cfg import assign_edges, parse_connectors
from vllm_omni_plugin.config.deploy import DeployConfig, StageConfig
from vllm_omni_plugin.config.detect import find_topology
from vllm_omni_plugin.config.errors import ProblemSink, did_you_mean
from vllm_omni_plugin.config.loading import LoadedFile, find_config_file, load_with_bases
from vllm_omni_plugin.config.overrides import parse_stage_overrides
from vllm_omni_plugin.config.owners_videos import video_jobs
from vllm_omni_plugin.config.pipeline_runtime import check_replicas, pipeline_runtime
from vllm_omni_plugin.config.provenance import Layered
from vllm_omni_plugin.config.sections import (
    check_declared_graph,
    platform_entries,
    serving_limits,
    stage_entries,
)
from vllm_omni_plugin.config.stage_build import build_stage
from vllm_omni_plugin.config.stage_keys import flatten_stage, route
from vllm_omni_plugin.pipelines import PipelineTopology

# Top-level fields applied to every stage they concern (precedence layer "pipeline").
PIPELINE_WIDE = (
    "trust_remote_code",
    "distributed_executor_backend",
    "dtype",
    "quantization",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "data_parallel_size",
    "pipeline_parallel_size",
)
TOP_KEYS = {
    "pipeline",
    "model",
    "async_chunk",
    "stages",
    "connectors",
    "edges",
    "platforms",
    "base_config",
    "serving",
    "videos",  # VideoJobs: the /v1/videos job store
    "runtime",
    *PIPELINE_WIDE,
}
# vLLM-Omni top-level settings for features this plugin does not have (warned, not errors).
TOP_IGNORED = {
    "session_mode",
    "model_runner",
    "duplex_session",
    "active_stream_window",
    "custom_voice_dir",
}


def detect_platform() -> str:
    """The platform whose `platforms:` section applies (no torch import: the CLI stays fast)."""
    forced = os.environ.get("VLLM_OMNI_PLUGIN_PLATFORM") or os.environ.get("VLLM_TARGET_DEVICE")
    if forced:
        return forced.lower()
    if Path("/dev/nvidiactl").exists():
        return "cuda"
    return "rocm" if Path("/dev/kfd").exists() else "cpu"


def load_deploy_config(
    path_or_name: str | Path,
    *,
    model: str | None = None,
    stage_overrides: str | dict | None = None,
    platform: str | None = None,
    strategy: dict | None = None,
    cli_overrides: dict[str, Any] | None = None,
) -> DeployConfig:
    """Load, migrate, merge, type and validate a deploy YAML; raises ConfigError.

    `model` is the `vllm serve` MODEL (beats the YAML's `model`); `stage_overrides` is the
    `--stage-overrides` JSON (or its dict); `cli_overrides` are engine flags given on the command
    line (applied to every stage that has the field); `strategy` is a stage-id-keyed mapping like
    `stage_overrides`, applied below the CLI.
    """
    platform = (platform or detect_platform()).lower()
    if str(path_or_name) == AUTO:
        path_or_name = auto_config_name(model, platform)
    path = find_config_file(path_or_name)
    sink = ProblemSink(str(path_or_name))
    warnings: list[str] = []
    files = load_with_bases(path, sink)
    sink.raise_if_any()
    docs = [(f, _migrated(f, sink, warnings)) for f in files]
    sink.raise_if_any()

    top = _merge_top([d for _, d in docs], sink, warnings)
    pipeline_model = model or top.get("model")
    if pipeline_model is not None and not isinstance(pipeline_model, str):
        sink.add(None, "model", "must be a model folder or hub id (a string)")
        pipeline_model = None
    stage_lists = [(_layer_name(f, path), stage_entries(d, sink)) for f, d in docs]
    sink.raise_if_any()
    if not any(entries for _, entries in stage_lists):
        sink.add(None, "stages", "no stages: list at least one `- stage_id: N` entry")
        sink.raise_if_any()
    all_entries = [
        {**e, "stage_id": sid} for _, entries in stage_lists for sid, e in entries.items()
    ]
    topo = find_topology(
        top.get("pipeline"), pipeline_model, all_entries, [f.path for f in files], sink
    )
    sink.raise_if_any()
    assert topo is not None
    for sid in sorted({sid for _, entries in stage_lists for sid in entries}):
        if sid not in topo.stage_ids:
            names = ", ".join(f"{s.stage_id} ({s.name})" for s in topo.stages)
            sink.add(
                sid, "stage_id", f"pipeline {topo.key!r} has no stage {sid}; its stages are {names}"
            )
    check_declared_graph(topo, stage_lists, sink)

    overrides = parse_stage_overrides(stage_overrides, sink)
    strategy_layer = parse_stage_overrides(strategy, sink)
    for sid in sorted(set(overrides) | set(strategy_layer)):
        if sid not in topo.stage_ids:
            sink.add(
                sid,
                "stage_overrides",
                f"no stage {sid} in pipeline {topo.key!r} (stages: {topo.stage_ids})",
            )
    platform_stages = platform_entries(top.get("platforms"), platform, topo, sink)
    serving = serving_limits(top.get("serving"), sink)
    videos = video_jobs(top.get("videos"), sink)
    runtime = pipeline_runtime(top.get("runtime"), sink)
    sink.raise_if_any()

    stages: list[StageConfig] = []
    for spec in topo.stages:
        layered = Layered()
        for label, entries in stage_lists:
            if spec.stage_id in entries:
                layered.apply(label, entries[spec.stage_id], _env_paths(files, spec.stage_id))
        if spec.stage_id in platform_stages:
            layered.apply(f"platform:{platform}", platform_stages[spec.stage_id])
        wide = {
            k: top[k]
            for k in PIPELINE_WIDE
            if k in top and route(k, spec.kind) not in ("ignored", "unknown")
        }
        layered.apply("pipeline", wide)
        if spec.stage_id in strategy_layer:
            layered.apply(
                "strategy", flatten_stage(strategy_layer[spec.stage_id], spec.stage_id, sink)
            )
        if cli_overrides:
            cli = {
                k: v
                for k, v in cli_overrides.items()
                if route(k, spec.kind) not in ("ignored", "unknown")
            }
            layered.apply("cli", cli)
        if spec.stage_id in overrides:
            layered.apply(
                "stage-overrides", flatten_stage(overrides[spec.stage_id], spec.stage_id, sink)
            )
        stage = build_stage(spec, topo, layered, pipeline_model, serving, sink, warnings)
        if stage is not None:
            stages.append(stage)
    check_replicas(stages, runtime, sink)
    _check_speech_room(topo, stages, sink)
    sink.raise_if_any()
    connectors = parse_connectors(top.get("connectors"), sink, warnings, topo.audio_output)
    edges = assign_edges(topo, top.get("edges"), stages, connectors, sink)
    sink.raise_if_any()
    _warn_async_chunk(top.get("async_chunk"), topo, warnings)
    _warn_streamed_connectors(top.get("edges"), topo, warnings)
    return DeployConfig(
        file=str(path),
        model=pipeline_model,
        pipeline=topo.key,
        topology=topo,
        stages=stages,
        edges=edges,
        connectors=connectors,
        serving=serving,
        videos=videos,
        runtime=runtime,
        platform=platform if platform_stages else None,
        async_chunk=bool(top.get("async_chunk")),
        warnings=warnings,
        provenance={
            "model": "cli" if model else ("yaml" if top.get("model") else "default"),
            "pipeline": "yaml" if top.get("pipeline") else "derived:detected",
            **_section_provenance(docs, path, {"serving": serving, "videos": videos}),
        },
    )


def _warn_async_chunk(value: Any, topo: Any, warnings: list[str]) -> None:
    """vLLM-Omni's `async_chunk` asks whether stages start on their inputs' first chunks. Here
    the topology fixes it: a value that says otherwise is warned about (nothing changes)."""
    if value is None:
        return
    streamed = all(topo.streams(a, b) for a, b in topo.edges) and bool(topo.edges)
    if bool(value) != streamed:
        how = (
            "stream: each stage starts on its inputs' first chunks"
            if streamed
            else "start after their inputs complete"
        )
        warnings.append(f"async_chunk: {value} ignored: the stages of {topo.key!r} {how}")


def _warn_streamed_connectors(raw_edges: Any, topo: Any, warnings: list[str]) -> None:
    """A streamed edge's chunks go from stage to stage over the edge's own channel
    (stages/edge_streams.py), never through a connector: one named for it does nothing."""
    for i, edge in enumerate(raw_edges or []):
        src, dst = edge.get("from", edge.get("from_stage")), edge.get("to", edge.get("to_stage"))
        if edge.get("connector") is not None and topo.streams(src, dst):
            warnings.append(
                f"edges[{i}].connector: {edge['connector']!r} is not used: edge {src} -> {dst} "
                "streams, its chunks go straight from stage to stage"
            )


def _section_provenance(
    docs: list[tuple[LoadedFile, dict[str, Any]]], main: Path, sections: dict[str, Any]
) -> dict[str, str]:
    """ "<section>.<field>" -> the file layer that set it, or "default". A section in a later
    file replaces the earlier one whole (_merge_top), so the last file that has it decides."""
    out: dict[str, str] = {}
    for name, owner in sections.items():
        last = [(f, d[name]) for f, d in docs if isinstance(d.get(name), dict)]
        for field in type(owner).model_fields:
            layer = "default"
            if last and field in last[-1][1]:
                layer = _layer_name(last[-1][0], main)
            out[f"{name}.{field}"] = layer
    return out


def _migrated(f: LoadedFile, sink: ProblemSink, warnings: list[str]) -> dict[str, Any]:
    if not legacy.is_legacy(f.data):
        return f.data
    warnings.append(f"{f.path.name} {legacy.DEPRECATION}")
    if "stages" in f.data:
        sink.add(
            None, "stage_args", "a file has either `stage_args` (legacy) or `stages`, not both"
        )
    return legacy.migrate(f.data, sink)


def _layer_name(f: LoadedFile, main: Path) -> str:
    return "yaml" if f.path == main else f"yaml:{f.path.name}"


def _merge_top(
    docs: list[dict[str, Any]], sink: ProblemSink, warnings: list[str]
) -> dict[str, Any]:
    top: dict[str, Any] = {}
    ignored: set[str] = set()
    for data in docs:
        for key, value in data.items():
            if key in TOP_IGNORED:
                ignored.add(key)
            elif key not in TOP_KEYS:
                sink.add(
                    None,
                    str(key),
                    "unknown top-level key" + did_you_mean(str(key), TOP_KEYS | TOP_IGNORED),
                )
            elif (
                key in ("platforms", "connectors")
                and isinstance(value, dict)
                and isinstance(top.get(key), dict)
            ):
                top[key] = {**top[key], **value}
            elif key != "stages":
                top[key] = value
    if ignored:
        warnings.append(
            f"ignored vLLM-Omni settings this plugin does not use: {', '.join(sorted(ignored))}"
        )
    return top


def _env_paths(files: list[LoadedFile], sid: int) -> dict[str, list[str]]:
    """Flattened field -> env vars, for values of stage `sid` interpolated from the environment."""
    out: dict[str, list[str]] = {}
    for f in files:
        stages = f.data.get("stages") or f.data.get("stage_args") or []
        for path, names in f.env_refs.items():
            if len(path) >= 3 and path[0] in ("stages", "stage_args") and isinstance(path[1], int):
                if (
                    path[1] < len(stages)
                    and isinstance(stages[path[1]], dict)
                    and stages[path[1]].get("stage_id") == sid
                ):
                    rest = [
                        p
                        for p in path[2:]
                        if p not in ("engine_args", "runtime", "parallel_config", "model_config")
                    ]
                    out[".".join(map(str, rest))] = names
    return out


def _check_speech_room(topo: PipelineTopology, stages: list[Any], sink: ProblemSink) -> None:
    """A speaking pipeline whose stage settings leave no room for a speech prompt is refused."""
    if topo.speech_prompt_limit is None or len(stages) != len(topo.stages):
        return  # (a stage that failed to build has its own problem already)
    room = topo.speech_prompt_limit(stages)
    if room < 1:
        sink.add(
            None,
            "max_model_len",
            f"the speech stages' max_model_len leaves {room} prompt ids for a speech answer "
            "after their frame cap (default_sampling_params.max_tokens) and head: raise "
            "max_model_len or lower max_tokens",
        )
