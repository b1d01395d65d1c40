"""Frozen pipeline topologies keyed by model type, and the registry others extend."""

from vllm_omni_plugin.pipelines.registry import (
    ENTRY_POINT_GROUP,
    UnsupportedPipelineError,
    available_pipelines,
    detect_pipeline,
    get_pipeline,
    pipeline_for_class,
    register_pipeline,
)
from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec, validate_graph

__all__ = [
    "ENTRY_POINT_GROUP",
    "PipelineTopology",
    "StageSpec",
    "UnsupportedPipelineError",
    "available_pipelines",
    "detect_pipeline",
    "get_pipeline",
    "pipeline_for_class",
    "register_pipeline",
    "validate_graph",
]
