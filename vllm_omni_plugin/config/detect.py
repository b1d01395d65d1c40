"""Which frozen pipeline a config is for.

Order: the YAML's `pipeline:`; the model folder (model_index.json `_class_name`, config.json
`model_type`); model class names in the stages (legacy `model_arch`, `model_class_name`); the file
name (vLLM-Omni names its deploy files after the pipeline, e.g. glm_image.yaml); well-known hub ids.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vllm_omni_plugin.config.errors import ProblemSink
from vllm_omni_plugin.pipelines import (
    PipelineTopology,
    UnsupportedPipelineError,
    available_pipelines,
    detect_pipeline,
    get_pipeline,
    pipeline_for_class,
)

_HUB_NAMES = {"glm-image": "glm_image", "qwen-image": "qwen_image", "flux.1": "flux"}


def find_topology(
    explicit: Any,
    model: str | None,
    stages: list[dict[str, Any]],
    files: list[Path],
    sink: ProblemSink,
) -> PipelineTopology | None:
    supported = ", ".join(available_pipelines())
    if explicit is not None:
        if not isinstance(explicit, str):
            sink.add(None, "pipeline", f"must be a pipeline name ({supported})")
            return None
        try:
            topo = get_pipeline(explicit)
        except UnsupportedPipelineError as exc:
            sink.add(None, "pipeline", str(exc))
            return None
        _check_model_matches(topo, model, sink)
        return topo
    if model:
        try:
            found = detect_pipeline(model)
        except UnsupportedPipelineError as exc:
            sink.add(None, "model", str(exc))
            return None
        except (OSError, ValueError) as exc:
            sink.add(None, "model", f"cannot read the model folder {model}: {exc}")
            return None
        if found:
            return get_pipeline(found[0])
    for stage in stages:
        for key in ("model_arch", "model_class_name", "pipeline_class"):
            name = stage.get(key)
            if isinstance(name, str) and name:
                topo = pipeline_for_class(name)
                if topo is None:
                    sink.add(
                        stage.get("stage_id"),
                        key,
                        f"unsupported pipeline: no pipeline of this plugin runs {name} (supported: {supported})",
                    )
                    return None
                return topo
    for path in files:
        topo = _from_name(path.stem)
        if topo:
            return topo
    if model:
        topo = _from_name(Path(model).name.lower())
        if topo:
            return topo
    if _looks_like_glm_image(stages):
        return get_pipeline("glm_image")
    names = ", ".join(p.stem for p in files)
    sink.add(
        None,
        "pipeline",
        f"unsupported pipeline: cannot tell which pipeline {names} is for; set `pipeline:` to one "
        f"of {supported}, or pass the model folder with --model",
    )
    return None


def _from_name(stem: str) -> PipelineTopology | None:
    stem = stem.lower().replace("-", "_")
    for key in sorted(available_pipelines(), key=len, reverse=True):
        if re.search(rf"(^|[_.]){re.escape(key)}($|[_.])", stem):
            return get_pipeline(key)
    for hub, key in _HUB_NAMES.items():
        if hub in stem:
            return get_pipeline(key)
    return None


def _check_model_matches(topo: PipelineTopology, model: str | None, sink: ProblemSink) -> None:
    if not model or topo.key == "diffusers":
        return
    try:
        found = detect_pipeline(model)
    except (UnsupportedPipelineError, OSError, ValueError):
        found = None
    if found and found[0] != topo.key and found[0] != "diffusers":
        sink.add(
            None,
            "pipeline",
            f"{topo.key!r} does not match the model {model} ({found[1]} is pipeline {found[0]!r})",
        )


def _looks_like_glm_image(stages: list[dict[str, Any]]) -> bool:
    """GLM-Image's AR stage stops on its image-end token 16385 and feeds one diffusion stage."""
    by_id = {s.get("stage_id"): s for s in stages}
    ar = by_id.get(0) or {}
    params = ar.get("default_sampling_params") or {}
    stops = params.get("stop_token_ids") if isinstance(params, dict) else None
    return set(by_id) <= {0, 1} and isinstance(stops, list) and 16385 in stops
