"""Connectors (named transports) and the edge -> connector assignment.

Accepted spellings: ours `{name: {type: shm|inproc|nixl, options: {...}}}` and vLLM-Omni's
`{name: {name: SharedMemoryConnector|NixlConnector, extra: {...}}}`; edges may name a connector
(`edges: [{from: 0, to: 1, connector: nixl}]`) or stages may (`input_connectors:
{from_stage_0: nixl}`, `output_connectors: {to_stage_1: nixl}`). Unnamed edges use shared memory.
"""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.config.deploy import ConnectorSpec, EdgeConfig, StageConfig
from vllm_omni_plugin.config.errors import ProblemSink, did_you_mean
from vllm_omni_plugin.pipelines import PipelineTopology

CONNECTOR_TYPES = {
    "shm": "shm",
    "shared_memory": "shm",
    "SharedMemoryConnector": "shm",
    "inproc": "inproc",
    "in_process": "inproc",
    "InProcessConnector": "inproc",
    "nixl": "nixl",
    "NixlConnector": "nixl",
    "OmniNixlConnector": "nixl",
}
DEFAULT_CONNECTOR = ConnectorSpec(name="shm", type="shm")
# The options each connector type's constructor takes (connectors/__init__.py make_connector):
# anything else would fail only when a stage opens the connector, so loading refuses it.
CONNECTOR_OPTIONS = {
    "inproc": ("lease_s",),
    "shm": ("lease_s", "shm_dir", "device"),
    "nixl": (
        "lease_s",
        "device",
        "agent_name",
        "send_pool_mb",
        "recv_pool_mb",
        "copy_threshold_mb",
        "poll_interval_s",
        "progress_delay_us",
        "backends",
    ),
}
# vLLM-Omni sets Qwen3-Omni's Code2Wav chunking on its connector (`extra:`). Here the Code2Wav
# engine fixes it (code2wav/config.py, the same numbers): on a pipeline that speaks, these
# values are accepted (they are what runs), others are refused.
CODE2WAV_CHUNKING = {
    "initial_codec_chunk_frames": 4,
    "codec_chunk_frames": 25,
    "codec_left_context_frames": 25,
}
_EDGE_KEYS = {"from", "to", "connector", "window_size", "max_inflight", "from_stage", "to_stage"}


def parse_connectors(
    raw: Any, sink: ProblemSink, warnings: list[str], audio_output: bool = False
) -> dict[str, ConnectorSpec]:
    """`audio_output`: the pipeline has a Code2Wav stage (CODE2WAV_CHUNKING applies)."""
    if raw is None:
        return {}
    if isinstance(raw, list):  # vLLM-Omni 0.16's per-edge tensor_transfer list
        warnings.append(
            "ignored the list-style `connectors` (vLLM-Omni 0.16 tensor_transfer "
            "fields); payloads use the default shared-memory connector"
        )
        return {}
    if not isinstance(raw, dict):
        sink.add(
            None, "connectors", "must be a mapping of connector name -> {type: shm|inproc|nixl}"
        )
        return {}
    out: dict[str, ConnectorSpec] = {}
    for name, spec in raw.items():
        field = f"connectors.{name}"
        if not isinstance(spec, dict):
            sink.add(None, field, "must be a mapping with a `type` (shm, inproc, nixl)")
            continue
        unknown = set(spec) - {"type", "name", "options", "extra"}
        for key in sorted(unknown):
            sink.add(None, f"{field}.{key}", "unknown key" + did_you_mean(key, ["type", "options"]))
        kind = spec.get("type", spec.get("name"))
        ctype = CONNECTOR_TYPES.get(str(kind)) if kind is not None else None
        if ctype is None:
            sink.add(
                None,
                f"{field}.type",
                f"unsupported connector {kind!r} (supported: shm, inproc, nixl)",
            )
            continue
        options = dict(spec.get("extra") or {})
        options.update(spec.get("options") or {})
        out[str(name)] = ConnectorSpec(
            name=str(name),
            type=ctype,
            options=_check_options(field, ctype, options, audio_output, sink),
        )
    return out


def _check_options(
    field: str, ctype: str, options: dict[str, Any], audio_output: bool, sink: ProblemSink
) -> dict[str, Any]:
    """The options the connector takes; the others are refused (Code2Wav's chunking is checked
    against the engine's and dropped: the connector does not take it)."""
    kept: dict[str, Any] = {}
    for key, value in options.items():
        fixed = CODE2WAV_CHUNKING.get(key)
        if fixed is not None and audio_output:
            if value != fixed:
                sink.add(
                    None,
                    f"{field}.{key}",
                    f"is {value!r}, but the Code2Wav stage's chunking is fixed (first chunk "
                    f"{CODE2WAV_CHUNKING['initial_codec_chunk_frames']} frames, then "
                    f"{CODE2WAV_CHUNKING['codec_chunk_frames']} with "
                    f"{CODE2WAV_CHUNKING['codec_left_context_frames']} frames of left context); "
                    f"set {fixed} or remove it",
                )
        elif key not in CONNECTOR_OPTIONS[ctype]:
            sink.add(
                None,
                f"{field}.{key}",
                f"not an option of the {ctype} connector (options: "
                f"{', '.join(CONNECTOR_OPTIONS[ctype])})"
                + did_you_mean(str(key), CONNECTOR_OPTIONS[ctype]),
            )
        else:
            kept[key] = value
    return kept


def assign_edges(
    topo: PipelineTopology,
    raw_edges: Any,
    stages: list[StageConfig],
    connectors: dict[str, ConnectorSpec],
    sink: ProblemSink,
) -> list[EdgeConfig]:
    chosen: dict[tuple[int, int], str] = {}
    topo_edges = set(topo.edges)
    for stage in stages:
        for key, name in (stage.connector.input_connectors or {}).items():
            _pick(
                chosen,
                _edge_of(key, "from_stage_", stage.stage_id, True),
                name,
                stage.stage_id,
                "input_connectors",
                sink,
            )
        for key, name in (stage.connector.output_connectors or {}).items():
            _pick(
                chosen,
                _edge_of(key, "to_stage_", stage.stage_id, False),
                name,
                stage.stage_id,
                "output_connectors",
                sink,
            )
    if raw_edges is not None and not isinstance(raw_edges, list):
        sink.add(None, "edges", "must be a list of {from: N, to: M, connector: NAME}")
        raw_edges = []
    for i, edge in enumerate(raw_edges or []):
        if not isinstance(edge, dict):
            sink.add(None, f"edges[{i}]", "must be a mapping {from: N, to: M}")
            continue
        for key in sorted(set(edge) - _EDGE_KEYS):
            sink.add(None, f"edges[{i}].{key}", "unknown key" + did_you_mean(key, _EDGE_KEYS))
        src, dst = edge.get("from", edge.get("from_stage")), edge.get("to", edge.get("to_stage"))
        if (src, dst) not in topo_edges:
            sink.add(
                None,
                f"edges[{i}]",
                f"{src} -> {dst} is not an edge of pipeline {topo.key!r} "
                f"(its edges: {', '.join(f'{a} -> {b}' for a, b in sorted(topo_edges)) or 'none'})",
            )
            continue
        if edge.get("connector") is not None:
            _pick(chosen, (src, dst), edge["connector"], None, f"edges[{i}].connector", sink)
    out = []
    for src, dst in sorted(topo_edges):
        name = chosen.get((src, dst), DEFAULT_CONNECTOR.name)
        if name not in connectors:
            if name == DEFAULT_CONNECTOR.name:
                connectors[name] = DEFAULT_CONNECTOR
            else:
                sink.add(
                    None,
                    "connectors",
                    f"edge {src} -> {dst} uses connector {name!r}, which is "
                    f"not defined{did_you_mean(name, connectors)}",
                )
                continue
        out.append(EdgeConfig(from_stage=src, to_stage=dst, connector=name))
    return out


def _edge_of(key: str, prefix: str, sid: int, incoming: bool) -> tuple[int, int] | None:
    if not key.startswith(prefix) or not key[len(prefix) :].isdigit():
        return None
    other = int(key[len(prefix) :])
    return (other, sid) if incoming else (sid, other)


def _pick(chosen, edge, name, sid, field, sink: ProblemSink) -> None:
    if edge is None:
        sink.add(sid, field, "keys must look like from_stage_N / to_stage_N")
        return
    previous = chosen.get(edge)
    if previous is not None and previous != name:
        sink.add(
            sid,
            field,
            f"edge {edge[0]} -> {edge[1]} is given two connectors: {previous!r} and {name!r}",
        )
    chosen[edge] = str(name)
