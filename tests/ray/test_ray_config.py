"""The pipeline's `runtime:` section and stage replicas, at load time (no Ray started)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import vllm_omni_plugin
from vllm_omni_plugin.config import ConfigError, load_deploy_config
from vllm_omni_plugin.config.consumers import CONSUMERS, Refused

PACKAGE = Path(vllm_omni_plugin.__file__).parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    return [p.format() for p in info.value.problems]


QWEN_REPLICAS = """
pipeline: qwen_image
stages:
  - stage_id: 0
    device: cpu
    num_replicas: 2
"""


def test_bundled_ray_config_has_two_dit_replicas_on_ray():
    cfg = load_deploy_config("qwen_image_tiny_ray")
    assert cfg.runtime.backend == "ray" and cfg.runtime.address == "auto"
    assert cfg.stage(0).kind == "diffusion" and cfg.stage(0).num_replicas == 2
    assert cfg.to_dict()["runtime"]["backend"] == "ray"


def test_replicas_are_refused_without_ray(tmp_path):
    lines = problems(write(tmp_path, QWEN_REPLICAS))
    assert any("stage 0: num_replicas: 2 is not supported" in line for line in lines), lines
    assert any("backend: ray" in line for line in lines), lines


def test_replicas_load_with_ray(tmp_path):
    short = QWEN_REPLICAS.replace("num_replicas", "replicas") + "runtime: {backend: ray}\n"
    assert load_deploy_config(write(tmp_path, short)).stage(0).num_replicas == 2  # the alias
    cfg = load_deploy_config(
        write(tmp_path, QWEN_REPLICAS + "runtime: {backend: ray, max_restarts: 3}\n")
    )
    assert cfg.stage(0).num_replicas == 2
    assert cfg.runtime.max_restarts == 3 and cfg.runtime.node_ip_address is None


@pytest.mark.parametrize(
    ("runtime", "field", "says"),
    [
        ("{backend: local, address: 'h:6379'}", "runtime.address", "backend: ray only"),
        ("{node_ip_address: 10.0.0.1}", "runtime.node_ip_address", "backend: ray only"),
        ("{backend: k8s}", "runtime.backend", "'local' or 'ray'"),
        ("{backend: ray, max_restart: 2}", "runtime.max_restart", "did you mean 'max_restarts'"),
        ("{backend: ray, max_restarts: -2}", "runtime.max_restarts", "greater than or equal"),
        ("ray", "runtime", "must be a mapping"),
    ],
)
def test_bad_runtime_is_refused_naming_the_field(tmp_path, runtime, field, says):
    text = "pipeline: qwen_image\nstages:\n  - stage_id: 0\n" + f"runtime: {runtime}\n"
    lines = problems(write(tmp_path, text))
    assert any(f"{field}: " in line and says in line for line in lines), lines


def test_refused_fields_that_act_elsewhere_name_their_consumer():
    # The consumer map says where a refused value is accepted instead, and that code reads it.
    unless = [
        (owner, field, fate)
        for (owner, field), fates in CONSUMERS.items()
        for fate in fates.values()
        if isinstance(fate, Refused) and fate.unless is not None
    ]
    assert ("RuntimeOwner", "num_replicas") in {(o, f) for o, f, _ in unless}
    for _, field, fate in unless:
        _, code = fate.unless
        assert field in (PACKAGE / code.path).read_text(), (field, code.path)
