"""Pipeline registry: topology key -> frozen topology, plus detection from a model folder.

Other packages add pipelines through the entry-point group `vllm_omni_plugin.pipelines`; each
entry point names a `PipelineTopology`, or a callable returning one or a list of them.
"""

from __future__ import annotations

import json
import logging
from importlib.metadata import entry_points
from pathlib import Path

from vllm_omni_plugin.pipelines.diffusers_single import (
    FLUX,
    GENERIC_DIFFUSERS,
    QWEN_IMAGE,
    WAN,
    WAN_I2V,
    Z_IMAGE,
)
from vllm_omni_plugin.pipelines.flux2_klein import FLUX2_KLEIN
from vllm_omni_plugin.pipelines.glm_image import GLM_IMAGE
from vllm_omni_plugin.pipelines.image_edits import FLUX_KONTEXT, QWEN_IMAGE_EDIT_PLUS
from vllm_omni_plugin.pipelines.qwen3_omni import QWEN3_OMNI
from vllm_omni_plugin.pipelines.qwen_image_edit import QWEN_IMAGE_EDIT
from vllm_omni_plugin.pipelines.topology import PipelineTopology

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm_omni_plugin.pipelines"
GENERIC_KEY = GENERIC_DIFFUSERS.key

_REGISTRY: dict[str, PipelineTopology] = {}
_entry_points_loaded = False


class UnsupportedPipelineError(ValueError):
    """The model or config names a pipeline no registered topology serves."""


def register_pipeline(topology: PipelineTopology, *, replace: bool = False) -> None:
    """Add a topology; its graph is validated first."""
    problems = topology.validate()
    if problems:
        raise ValueError(f"pipeline {topology.key!r} is not a valid graph: " + "; ".join(problems))
    if topology.key in _REGISTRY and not replace:
        raise ValueError(f"pipeline {topology.key!r} is already registered")
    _REGISTRY[topology.key] = topology


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            found = obj() if callable(obj) and not isinstance(obj, PipelineTopology) else obj
            for topo in found if isinstance(found, (list, tuple)) else [found]:
                register_pipeline(topo, replace=True)
        except Exception as exc:  # a broken third-party plugin must not break our configs
            logger.warning("pipeline entry point %s failed to load: %s", ep.name, exc)


def available_pipelines() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def get_pipeline(key: str) -> PipelineTopology:
    """The topology registered under `key`; raises UnsupportedPipelineError otherwise."""
    _load_entry_points()
    if key not in _REGISTRY:
        raise UnsupportedPipelineError(
            f"unsupported pipeline {key!r}: this plugin serves {', '.join(available_pipelines())}"
        )
    return _REGISTRY[key]


def pipeline_for_class(name: str) -> PipelineTopology | None:
    """The topology selected by a diffusers pipeline class or model architecture name."""
    _load_entry_points()
    for topo in _REGISTRY.values():
        if name in topo.diffusers_class_names or name in topo.hf_architectures:
            return topo
    return None


def detect_pipeline(model: str | Path) -> tuple[str, str] | None:
    """(pipeline key, reason) for a local model folder, or None when it is not a folder.

    A diffusers folder is keyed by model_index.json `_class_name` (any other class gets the
    generic fallback); an HF folder by config.json `model_type` / `architectures`.
    Raises UnsupportedPipelineError for an HF model we have no topology for.
    """
    _load_entry_points()
    root = Path(model)
    index = root / "model_index.json"
    if index.is_file():
        class_name = str(json.loads(index.read_text()).get("_class_name", ""))
        topo = pipeline_for_class(class_name)
        why = f"model_index.json _class_name {class_name}"
        return (topo.key if topo else GENERIC_KEY), why
    config = root / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        model_type = str(data.get("model_type", ""))
        for topo in _REGISTRY.values():
            if model_type in topo.hf_model_types:
                return topo.key, f"config.json model_type {model_type}"
        for arch in data.get("architectures") or []:
            topo = pipeline_for_class(arch)
            if topo:
                return topo.key, f"config.json architectures {arch}"
        raise UnsupportedPipelineError(
            f"unsupported pipeline: {root} has model_type {model_type!r}; this plugin serves "
            f"{', '.join(available_pipelines())}"
        )
    return None


def diffusers_class_of(model: str | Path) -> str | None:
    """model_index.json `_class_name` of a local diffusers folder, else None."""
    index = Path(model) / "model_index.json"
    if index.is_file():
        try:
            return str(json.loads(index.read_text()).get("_class_name")) or None
        except (OSError, ValueError):
            return None
    return None


for _topo in (GLM_IMAGE, QWEN_IMAGE, FLUX, WAN, Z_IMAGE, GENERIC_DIFFUSERS):
    register_pipeline(_topo)
register_pipeline(QWEN_IMAGE_EDIT)
register_pipeline(QWEN3_OMNI)
register_pipeline(FLUX2_KLEIN)
register_pipeline(FLUX_KONTEXT)
register_pipeline(QWEN_IMAGE_EDIT_PLUS)
register_pipeline(WAN_I2V)
