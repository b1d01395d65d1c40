"""`step_cache:` in the deploy file: `config validate` shows it with provenance; an unknown
policy, an out-of-range threshold, a default outside `policies` and vLLM-Omni's cache_backend are
refused at load naming the field; the engine config receives the section whole."""

from __future__ import annotations

import textwrap

import pytest

from vllm_omni_plugin.cli import main
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.diffusion.config import DiffusionEngineConfig

GOOD = """
pipeline: qwen_image
stages:
  - stage_id: 0
    device: cpu
    step_cache:
      policies: [first_block, taylorseer]
      max_threshold: 0.5
      default: {policy: first_block, threshold: 0.08}
"""


def write(tmp_path, text: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_validate_shows_step_cache_with_provenance(tmp_path, capsys):
    assert main(["config", "validate", str(write(tmp_path, GOOD))]) == 0
    out = capsys.readouterr().out
    assert "step_cache: policies=['first_block', 'taylorseer'] (yaml)" in out
    assert "max_threshold=0.5 (yaml)" in out
    assert "default={'policy': 'first_block', 'threshold': 0.08} (yaml)" in out


def test_validate_shows_step_cache_off(tmp_path, capsys):
    off = "pipeline: qwen_image\nstages:\n  - stage_id: 0\n    device: cpu\n"
    assert main(["config", "validate", str(write(tmp_path, off))]) == 0
    assert "step_cache: off (default)" in capsys.readouterr().out


def test_engine_config_gets_the_section(tmp_path):
    cfg = load_deploy_config(str(write(tmp_path, GOOD)), model=str(tmp_path))
    engine = DiffusionEngineConfig.from_stage_config(cfg.stages[0])
    assert engine.step_cache == {
        "policies": ["first_block", "taylorseer"],
        "max_threshold": 0.5,
        "default": {"policy": "first_block", "threshold": 0.08},
    }


@pytest.mark.parametrize(
    "section, message",
    [
        ("policies: [fast]", "'fast' is not one of"),
        ("policies: [first_block]\n      max_threshold: 0", "max_threshold"),
        (
            "policies: [first_block]\n      default: {policy: first_block, threshold: 20}",
            "default.threshold",
        ),
        (
            "policies: [first_block]\n      max_threshold: 0.2\n"
            "      default: {policy: first_block, threshold: 0.3}",
            "exceeds this stage's max_threshold",
        ),
        ("policies: [first_block]\n      default: {policy: teacache}", "not enabled"),
    ],
)
def test_bad_step_cache_refused_at_load(tmp_path, capsys, section, message):
    text = f"pipeline: qwen_image\nstages:\n  - stage_id: 0\n    step_cache:\n      {section}\n"
    assert main(["config", "validate", str(write(tmp_path, text))]) == 1
    err = capsys.readouterr().err
    assert "step_cache" in err or "cuda_graphs" in err
    assert message in err


def test_vllm_omni_cache_backend_refused_naming_step_cache(tmp_path, capsys):
    text = "pipeline: qwen_image\nstages:\n  - stage_id: 0\n    cache_backend: tea_cache\n"
    assert main(["config", "validate", str(write(tmp_path, text))]) == 1
    err = capsys.readouterr().err
    assert "cache_backend" in err and "step_cache" in err


def test_step_cache_keeps_cuda_graphs(tmp_path):
    """Step caching no longer turns CUDA graphs off: `cuda_graphs: true` beside it loads and
    reaches the engine config (the engine replays graphs where no row takes a per-row path)."""
    text = GOOD.replace("    step_cache:", "    cuda_graphs: true\n    step_cache:")
    cfg = load_deploy_config(str(write(tmp_path, text)), model=str(tmp_path))
    engine = DiffusionEngineConfig.from_stage_config(cfg.stages[0])
    assert engine.cuda_graphs is True
    assert engine.step_cache["policies"] == ["first_block", "taylorseer"]
