"""Stage defaults a Qwen-Image checkpoint would not read are refused at load, naming the field
(config/family_defaults.py): `guidance_scale` beside `true_cfg_scale` in default_sampling_params
of a transformer without embedded guidance (diffusers takes true_cfg_scale as the CFG scale and
ignores guidance_scale there), from the deploy file or --stage-overrides. Read from the model
folder's own transformer/config.json (written here as a checkpoint has it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from config_helpers import load, problems, write

BOTH = {"guidance_scale": 3.0, "true_cfg_scale": 4.0}
FIELD = "default_sampling_params.guidance_scale"


def qwen_folder(tmp_path: Path, pipeline: str, guidance_embeds: bool) -> Path:
    folder = tmp_path / f"{pipeline}-{guidance_embeds}"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    (folder / "transformer" / "config.json").write_text(
        json.dumps(
            {"_class_name": "QwenImageTransformer2DModel", "guidance_embeds": guidance_embeds}
        )
    )
    return folder


def deploy(pipeline: str, defaults: dict | None) -> str:
    text = f"pipeline: {pipeline}\nstages:\n  - stage_id: 0\n    device: cpu\n"
    if defaults:
        text += f"    default_sampling_params: {json.dumps(defaults)}\n"
    return text


@pytest.mark.parametrize(
    ("pipeline", "cls"),
    [
        ("qwen_image", "QwenImagePipeline"),
        ("qwen_image_edit", "QwenImageEditPipeline"),
        ("qwen_image_edit_plus", "QwenImageEditPlusPipeline"),
    ],
)
def test_guidance_scale_beside_true_cfg_scale_is_refused_naming_it(tmp_path, pipeline, cls):
    model = str(qwen_folder(tmp_path, cls, guidance_embeds=False))
    lines = problems(write(tmp_path, deploy(pipeline, BOTH)), model=model)
    assert len(lines) == 1 and f"stage 0: {FIELD}: is ignored" in lines[0], lines
    assert "true_cfg_scale is the CFG scale" in lines[0]
    # The same request defaults set on the command line.
    overrides = json.dumps({"0": {"default_sampling_params": BOTH}})
    lines = problems(
        write(tmp_path, deploy(pipeline, None)), model=model, stage_overrides=overrides
    )
    assert len(lines) == 1 and f"{FIELD}: is ignored" in lines[0], lines


def test_what_the_checkpoint_reads_still_loads(tmp_path):
    plain = str(qwen_folder(tmp_path, "QwenImagePipeline", guidance_embeds=False))
    distilled = str(qwen_folder(tmp_path, "QwenImagePipeline", guidance_embeds=True))
    # guidance_scale alone stands for true_cfg_scale; true_cfg_scale alone is the scale.
    for defaults in ({"guidance_scale": 3.0}, {"true_cfg_scale": 4.0}):
        cfg = load(tmp_path, deploy("qwen_image", defaults), model=plain)
        assert cfg.stage(0).sampling.defaults_dict() == defaults
    # A guidance-distilled transformer reads guidance_scale as its embedded guidance.
    cfg = load(tmp_path, deploy("qwen_image", BOTH), model=distilled)
    assert cfg.stage(0).sampling.defaults_dict() == BOTH


def test_wan_knobs_are_not_stage_defaults(tmp_path):
    """Wan2.2's guidance_scale_2 and boundary_ratio are per-request knobs (checked against the
    served checkpoint's experts); a deploy file setting them as defaults is refused at load,
    naming each, rather than carried where a one-expert model would leave them unread."""
    defaults = {"guidance_scale_2": 3.0, "boundary_ratio": 0.0}
    lines = problems(write(tmp_path, deploy("wan", defaults)))
    for name in defaults:
        assert any(f"stage 0: default_sampling_params.{name}: unknown key" in x for x in lines), (
            lines
        )
