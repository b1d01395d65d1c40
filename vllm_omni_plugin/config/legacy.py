"""Migration of vLLM-Omni's legacy `stage_args` schema to the `stages` schema.

Legacy files nest engine knobs under `engine_args:` and placement under `runtime:`, declare the
graph per stage (`engine_input_source`, `final_output`), and carry a top-level `runtime:` block
with edges. After migration they get exactly the same defaults and validation as new files.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm_omni_plugin.config.errors import ProblemSink

DEPRECATION = (
    "uses the deprecated `stage_args` schema; it was migrated to the `stages` schema. "
    "Run `vllm-omni-plugin config migrate FILE` and use its output instead"
)

# Legacy `runtime:` keys of a stage and what they become.
_STAGE_RUNTIME = {
    "devices": "devices",
    "max_batch_size": "max_batch_size",
    "num_replicas": "num_replicas",
    "env": "env",
}


def is_legacy(data: dict[str, Any]) -> bool:
    return "stage_args" in data


def migrate(data: dict[str, Any], sink: ProblemSink) -> dict[str, Any]:
    """A stages-schema mapping equivalent to the legacy `data` (problems go to `sink`)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in ("stage_args", "runtime"):
            out[key] = copy.deepcopy(value)
    stage_args = data.get("stage_args")
    if not isinstance(stage_args, list):
        sink.add(None, "stage_args", "must be a list of stages")
        stage_args = []
    stages = []
    for index, entry in enumerate(stage_args):
        if not isinstance(entry, dict):
            sink.add(None, f"stage_args[{index}]", "each stage must be a mapping")
            continue
        stages.append(_migrate_stage(entry, sink))
    out["stages"] = stages
    top_runtime = data.get("runtime")
    if isinstance(top_runtime, dict):
        edges = top_runtime.get("edges")
        if isinstance(edges, list) and "edges" not in out:
            out["edges"] = copy.deepcopy(edges)
    elif top_runtime is not None:
        sink.add(None, "runtime", "the top-level runtime block must be a mapping")
    return out


def _migrate_stage(entry: dict[str, Any], sink: ProblemSink) -> dict[str, Any]:
    stage: dict[str, Any] = {}
    sid = entry.get("stage_id")
    for key, value in entry.items():
        if key == "engine_args":
            if not isinstance(value, dict):
                sink.add(sid if isinstance(sid, int) else None, "engine_args", "must be a mapping")
                continue
            for k, v in value.items():
                stage[k] = copy.deepcopy(v)
        elif key == "runtime":
            if not isinstance(value, dict):
                sink.add(sid if isinstance(sid, int) else None, "runtime", "must be a mapping")
                continue
            for k, v in value.items():
                # process / requires_multimodal_data etc. are topology-owned: kept so that the
                # resolver names them in its "ignored" warning.
                stage[_STAGE_RUNTIME.get(k, k)] = copy.deepcopy(v)
        else:
            stage[key] = copy.deepcopy(value)
    # A legacy LLM stage's runtime.max_batch_size is vLLM's max_num_seqs.
    if entry.get("stage_type", "llm") == "llm" and "max_batch_size" in stage:
        batch = stage.pop("max_batch_size")
        stage.setdefault("max_num_seqs", batch)
    # engine knobs first, identity and sampling on top: the usual reading order.
    ordered = {"stage_id": stage.pop("stage_id", sid)}
    ordered.update(stage)
    return ordered
