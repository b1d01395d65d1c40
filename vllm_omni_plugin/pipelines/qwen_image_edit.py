"""Qwen-Image-Edit: one diffusion stage that edits one source image (POST /v1/images/edits)."""

from __future__ import annotations

import dataclasses

from vllm_omni_plugin.pipelines.diffusers_single import single_diffusion_stage

# Edit-only: every request carries exactly one image (the generations route answers 400);
# QwenImageEditPipeline has no inpainting, so a mask is a 400 too.
QWEN_IMAGE_EDIT = dataclasses.replace(
    single_diffusion_stage(
        "qwen_image_edit",
        "QwenImageEditPipeline",
        class_names=("QwenImageEditPipeline",),
        description="Qwen-Image-Edit: one diffusion stage, one source image per request",
    ),
    max_input_images=1,
    requires_input_image=True,
    accepts_mask=False,
)
