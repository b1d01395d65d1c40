"""Stage defaults (a deploy file's default_sampling_params) that the model would not read are
refused when the stage loads, naming the field, by the rule a request's own field gets a 400
under: a field the family refuses (Z-Image's guidance_scale: no CFG), and FLUX's guidance_scale
on a transformer without embedded guidance (diffusers ignores it there)."""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig
from vllm_omni_plugin.diffusion.errors import DiffusionEngineError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine(folder, **defaults) -> DiffusionEngine:
    return DiffusionEngine(DiffusionEngineConfig(model=str(folder), defaults=defaults))


def test_a_default_the_family_refuses_is_refused_at_load(tiny_models):
    folder = tiny_models("z-image")
    with pytest.raises(DiffusionEngineError, match=r"default_sampling_params\.guidance_scale"):
        engine(folder, guidance_scale=2.0)
    with pytest.raises(DiffusionEngineError, match=r"default_sampling_params\.negative_prompt"):
        engine(folder, negative_prompt="blurry")
    assert engine(folder, num_inference_steps=3).defaults == {"num_inference_steps": 3}


def test_flux_guidance_default_needs_embedded_guidance(tiny_models, tmp_path):
    distilled = tiny_models("flux")
    assert engine(distilled, guidance_scale=2.0).adapter.guidance_distilled
    plain = tmp_path / "flux-no-guidance"
    shutil.copytree(distilled, plain)
    config_file = plain / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "guidance_embeds": False}))
    with pytest.raises(DiffusionEngineError, match=r"default_sampling_params\.guidance_scale"):
        engine(plain, guidance_scale=2.0)
    assert not engine(plain, true_cfg_scale=2.0).adapter.guidance_distilled
