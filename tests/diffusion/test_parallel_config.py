"""cfg_parallel / ulysses_degree at config load: typed, checked against the stage's devices,
and carried whole to the diffusion engine's config."""

from __future__ import annotations

import pytest

from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.config.resolve import load_deploy_config
from vllm_omni_plugin.diffusion import DiffusionEngineConfig


def engine_config(overrides: dict) -> DiffusionEngineConfig:
    cfg = load_deploy_config("glm_image_tiny", model="/m", stage_overrides={"1": overrides})
    stage = next(s for s in cfg.stages if s.stage_id == 1)
    return DiffusionEngineConfig.from_stage_config(stage)


def test_cpu_stage_runs_gloo_ranks_without_devices():
    c = engine_config({"cfg_parallel": True, "ulysses_degree": 2})
    assert (c.cfg_parallel, c.ulysses_degree, c.world_size, c.device) == (True, 2, 4, "cpu")
    assert engine_config({}).world_size == 1


def test_gpu_stage_needs_a_device_per_rank():
    ok = engine_config({"device": "cuda", "devices": "0,1", "cfg_parallel": True})
    assert ok.world_size == 2
    with pytest.raises(ConfigError, match=r"ulysses_degree.*needs 4 devices.*lists 2"):
        engine_config(
            {"device": "cuda", "devices": "0,1", "cfg_parallel": True, "ulysses_degree": 2}
        )
    with pytest.raises(ConfigError, match=r"cfg_parallel.*needs 2 devices.*is not set"):
        engine_config({"device": "cuda", "cfg_parallel": True})


@pytest.mark.parametrize("value", [0, "two", 1.5])
def test_bad_ulysses_degree_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match="ulysses_degree"):
        engine_config({"ulysses_degree": value})
