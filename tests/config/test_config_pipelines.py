"""Rule 2: frozen topologies, the registry, detection from model folders, graph validation."""

from __future__ import annotations

import json

import pytest
from config_helpers import GLM_MIN, load, problems, write

from vllm_omni_plugin.pipelines import (
    PipelineTopology,
    StageSpec,
    UnsupportedPipelineError,
    available_pipelines,
    detect_pipeline,
    get_pipeline,
    register_pipeline,
    validate_graph,
)


def test_glm_image_topology():
    topo = get_pipeline("glm_image")
    ar, dit = topo.stages
    assert (ar.kind, ar.emits, ar.inputs, ar.final_output) == ("ar", "token_ids", [], False)
    assert (ar.model_subdir, ar.tokenizer_subdir) == ("vision_language_encoder", "processor")
    assert (dit.kind, dit.emits, dit.inputs, dit.final_output) == ("diffusion", "image", [0], True)
    assert dit.model_subdir is None
    for key in ("qwen_image", "flux", "diffusers"):
        (only,) = get_pipeline(key).stages
        assert only.kind == "diffusion" and only.final_output and only.inputs == []


def _folder(tmp_path, name, **files):
    root = tmp_path / name
    root.mkdir()
    for fname, data in files.items():
        (root / fname).write_text(json.dumps(data))
    return root


def test_detect_from_model_index_and_config(tmp_path):
    cases = {
        "GlmImagePipeline": "glm_image",
        "QwenImagePipeline": "qwen_image",
        "FluxPipeline": "flux",
        "StableDiffusion3Pipeline": "diffusers",
    }
    for cls, key in cases.items():
        root = _folder(tmp_path, cls, **{"model_index.json": {"_class_name": cls}})
        assert detect_pipeline(root)[0] == key
    hf = _folder(tmp_path, "hf", **{"config.json": {"model_type": "glm_image"}})
    assert detect_pipeline(hf)[0] == "glm_image"
    llama = _folder(tmp_path, "llama", **{"config.json": {"model_type": "llama"}})
    with pytest.raises(UnsupportedPipelineError, match="unsupported pipeline"):
        detect_pipeline(llama)


def test_generic_fallback_reads_pipeline_class(tmp_path):
    root = _folder(
        tmp_path, "sd3", **{"model_index.json": {"_class_name": "StableDiffusion3Pipeline"}}
    )
    cfg = load(tmp_path, "stages:\n  - stage_id: 0\n    device: cpu\n", model=str(root))
    assert cfg.pipeline == "diffusers"
    assert cfg.stage(0).diffusion.pipeline_class == "StableDiffusion3Pipeline"
    assert cfg.stage(0).model_path == str(root)


def test_model_mismatching_explicit_pipeline_is_an_error(tmp_path):
    root = _folder(tmp_path, "flux", **{"model_index.json": {"_class_name": "FluxPipeline"}})
    lines = problems(write(tmp_path, GLM_MIN), model=str(root))
    assert any("pipeline" in line and "flux" in line for line in lines)


def test_unsupported_pipeline_name(tmp_path):
    (line,) = problems(write(tmp_path, "pipeline: bagel\nstages: [{stage_id: 0}]\n"))
    assert "pipeline: unsupported pipeline 'bagel'" in line and "glm_image" in line


def test_graph_validation():
    assert validate_graph({0: [], 1: [0]}, [1]) == []
    assert any("does not exist" in p for p in validate_graph({0: [], 1: [3]}, [1]))
    assert any("cycle" in p for p in validate_graph({0: [], 1: [2], 2: [1]}, [2]))
    assert any("no entry stage" in p for p in validate_graph({0: [1], 1: [0]}, [1]))
    assert any("final output" in p for p in validate_graph({0: []}, []))
    assert any("duplicate" in p for p in validate_graph({0: []}, [0], duplicates=[0]))
    assert validate_graph({}, [])


def test_registry_is_open_and_validates():
    bad = PipelineTopology(
        "bad_loop",
        (StageSpec(0, "a", "ar", [1]), StageSpec(1, "b", "diffusion", [0], final_output=True)),
    )
    with pytest.raises(ValueError, match="cycle"):
        register_pipeline(bad)
    good = PipelineTopology(
        "test_two_dit", (StageSpec(0, "dit", "diffusion", [], final_output=True),)
    )
    register_pipeline(good, replace=True)
    assert "test_two_dit" in available_pipelines() and get_pipeline("test_two_dit") is good
    with pytest.raises(ValueError, match="already registered"):
        register_pipeline(good)


def test_fan_out_is_refused_until_the_orchestrator_can_run_it():
    problems = validate_graph({0: [], 1: [0], 2: [0]}, [1, 2])
    assert any("stage 0 feeds stages [1, 2]" in p and "fan-out" in p for p in problems)
    assert validate_graph({0: [], 1: [0], 2: [0, 1]}, [2]) != []  # 0 feeds 1 and 2
    assert validate_graph({0: [], 1: [], 2: [0, 1]}, [2]) == []  # fan-in is fine


def test_fan_out_topology_cannot_be_registered():
    topo = PipelineTopology(
        key="fan_out_test",
        stages=(
            StageSpec(0, "ar", "ar", emits="token_ids"),
            StageSpec(1, "a", "diffusion", inputs=[0], final_output=True),
            StageSpec(2, "b", "diffusion", inputs=[0], final_output=True),
        ),
    )
    with pytest.raises(ValueError, match="fan-out"):
        register_pipeline(topo)
