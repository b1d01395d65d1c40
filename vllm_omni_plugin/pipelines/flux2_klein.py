"""FLUX.2 klein: one diffusion stage; text to image (POST /v1/images/generations) and edits
with up to 4 reference images (POST /v1/images/edits, `image` or `image[]`)."""

from __future__ import annotations

import dataclasses

from vllm_omni_plugin.pipelines.diffusers_single import single_diffusion_stage

# Edits are optional (a request without images is text to image); Flux2KleinPipeline has no
# inpainting, so a mask is a 400. Reference images: the adapter's bound (max_input_images),
# and diffusers' own check (Flux2ImageProcessor.check_image_input: at most 8:1, at least 64
# pixels a side), answered by the API server before any stage.
FLUX2_KLEIN = dataclasses.replace(
    single_diffusion_stage(
        "flux2_klein",
        "Flux2KleinPipeline",
        class_names=("Flux2KleinPipeline",),
        description="FLUX.2 klein: one diffusion stage, text to image or up to 4 reference images",
    ),
    max_input_images=4,
    requires_input_image=False,
    accepts_mask=False,
    max_input_aspect_ratio=8.0,
    min_input_side=64,
)
