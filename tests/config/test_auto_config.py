"""`--stage-config auto`: the model's model_index.json `_class_name` picks the bundled deploy
file (the one-GPU file on a GPU, the CPU file elsewhere); an unknown class is refused with the
supported ones."""

from __future__ import annotations

import json

import pytest

from vllm_omni_plugin.config import ConfigError, load_deploy_config
from vllm_omni_plugin.config.auto_config import AUTO_CONFIGS, AUTO_VARIANTS
from vllm_omni_plugin.config.loading import find_config_file
from vllm_omni_plugin.pipelines import get_pipeline


def folder(tmp_path, class_name: str, **flags):
    model = tmp_path / class_name
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": class_name, **flags}))
    return model


@pytest.mark.parametrize(
    ("class_name", "platform", "file"),
    [
        ("ZImagePipeline", "cpu", "z_image_tiny.yaml"),
        ("ZImagePipeline", "cuda", "z_image.yaml"),
        ("Flux2KleinPipeline", "cpu", "flux2_klein_tiny.yaml"),
        ("FluxPipeline", "cuda", "flux.yaml"),
    ],
)
def test_auto_picks_the_family_file_for_the_platform(tmp_path, class_name, platform, file):
    model = folder(tmp_path, class_name)
    cfg = load_deploy_config("auto", model=str(model), platform=platform)
    assert cfg.file.endswith(f"stage_configs/{file}")
    assert cfg.model == str(model)


@pytest.mark.parametrize(
    ("flags", "platform", "file"),
    [
        ({"expand_timesteps": False}, "cpu", "wan_tiny.yaml"),  # Wan2.2 T2V-A14B
        ({"expand_timesteps": True}, "cpu", "wan_ti2v_tiny.yaml"),  # Wan2.2 TI2V-5B
        ({"expand_timesteps": True}, "cuda", "wan2_2_ti2v.yaml"),
    ],
)
def test_auto_tells_wan_ti2v_from_t2v_by_expand_timesteps(tmp_path, flags, platform, file):
    model = folder(tmp_path, "WanPipeline", **flags)
    assert load_deploy_config("auto", model=str(model), platform=platform).file.endswith(file)
    i2v = folder(tmp_path, "WanImageToVideoPipeline")  # Wan2.2 I2V-A14B
    cfg = load_deploy_config("auto", model=str(i2v), platform=platform)
    assert cfg.file.endswith("wan_i2v_tiny.yaml" if platform == "cpu" else "wan2_2_i2v.yaml")


def test_every_auto_file_exists_and_serves_its_class():
    variants = {(cls, name) for (cls, _), names in AUTO_VARIANTS.items() for name in names}
    for class_name, name in variants:
        cfg = load_deploy_config(name, platform="cpu")
        assert class_name in get_pipeline(cfg.pipeline).diffusers_class_names, name
    for class_name, names in AUTO_CONFIGS.items():
        for name in names:
            path = find_config_file(name)
            assert path.is_file(), name
            cfg = load_deploy_config(name, platform="cpu")
            assert class_name in get_pipeline(cfg.pipeline).diffusers_class_names, name


def test_unknown_class_is_refused_with_the_supported_ones(tmp_path):
    model = folder(tmp_path, "StableDiffusion3Pipeline")
    with pytest.raises(ConfigError) as info:
        load_deploy_config("auto", model=str(model), platform="cpu")
    message = str(info.value)
    assert "StableDiffusion3Pipeline" in message
    assert all(name in message for name in AUTO_CONFIGS)


def test_auto_needs_a_diffusers_model(tmp_path):
    with pytest.raises(ConfigError, match="pass MODEL"):
        load_deploy_config("auto", platform="cpu")
    with pytest.raises(ConfigError, match="no model_index.json"):
        load_deploy_config("auto", model=str(tmp_path), platform="cpu")
