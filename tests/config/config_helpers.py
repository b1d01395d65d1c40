"""Small helpers for the config tests (no torch / vLLM needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from vllm_omni_plugin.config import ConfigError, load_deploy_config

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]

GLM_MIN = """
pipeline: glm_image
stages:
  - stage_id: 0
    devices: "0"
  - stage_id: 1
    devices: "1"
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, **kwargs) -> list[str]:
    """Formatted problem lines; fails the test when the config loads."""
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path, **kwargs)
    return [p.format() for p in info.value.problems]


def load(tmp_path: Path, text: str, **kwargs):
    return load_deploy_config(write(tmp_path, text), **kwargs)
