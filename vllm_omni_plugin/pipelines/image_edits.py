"""Edit families beyond Qwen-Image-Edit: one diffusion stage each, source images through
POST /v1/images/edits (`image` or `image[]`), no mask (neither pipeline inpaints)."""

from __future__ import annotations

import dataclasses

from vllm_omni_plugin.pipelines.diffusers_single import single_diffusion_stage

# FLUX.1-Kontext: one source image; without one it generates from text (diffusers allows
# `image=None`), so the generations route serves it too.
FLUX_KONTEXT = dataclasses.replace(
    single_diffusion_stage(
        "flux_kontext",
        "FluxKontextPipeline",
        class_names=("FluxKontextPipeline",),
        description="FLUX.1-Kontext: one diffusion stage, edits of one source image",
    ),
    max_input_images=1,
)
# Qwen-Image-Edit-2509 / 2511: 1 to 4 source images per edit, every request carries one.
QWEN_IMAGE_EDIT_PLUS = dataclasses.replace(
    single_diffusion_stage(
        "qwen_image_edit_plus",
        "QwenImageEditPlusPipeline",
        class_names=("QwenImageEditPlusPipeline",),
        description="Qwen-Image-Edit-2509/2511: one diffusion stage, up to 4 source images",
    ),
    max_input_images=4,
    requires_input_image=True,
)
