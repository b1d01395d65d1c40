"""Single diffusion-stage pipelines: Qwen-Image, FLUX, and any other diffusers pipeline."""

from __future__ import annotations

import dataclasses

from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec


def single_diffusion_stage(
    key: str,
    pipeline_class: str | None,
    *,
    class_names: tuple[str, ...] = (),
    model_types: tuple[str, ...] = (),
    granularity: int = 16,
    description: str = "",
    emits: str = "image",
) -> PipelineTopology:
    """A pipeline made of one diffusion stage over the whole checkpoint folder."""
    dit = StageSpec(
        stage_id=0,
        name="dit",
        kind="diffusion",
        inputs=[],
        emits=emits,
        final_output=True,
        pipeline_class=pipeline_class,
    )
    return PipelineTopology(
        key=key,
        stages=(dit,),
        diffusers_class_names=class_names,
        hf_model_types=model_types,
        hf_architectures=class_names,
        size_granularity=granularity,
        description=description,
    )


# VAE scale 8 x transformer patch 2 for both families.
QWEN_IMAGE = single_diffusion_stage(
    "qwen_image",
    "QwenImagePipeline",
    class_names=("QwenImagePipeline",),
    model_types=("qwen_image",),
    description="Qwen-Image: one diffusion stage",
)
FLUX = single_diffusion_stage(
    "flux",
    "FluxPipeline",
    class_names=("FluxPipeline",),
    model_types=("flux",),
    description="FLUX.1: one diffusion stage",
)
# Z-Image-Turbo: VAE scale 8 x transformer patch 2; text-to-image without CFG.
Z_IMAGE = single_diffusion_stage(
    "z_image",
    "ZImagePipeline",
    class_names=("ZImagePipeline",),
    description="Z-Image-Turbo: one diffusion stage",
)
# Wan2.1 / Wan2.2 text-to-video: VAE scale 8 x transformer patch 2; served on /v1/videos.
# Wan2.2 TI2V-5B is a WanPipeline too: it also takes an optional source image
# (`input_reference`), which its stage announces (VideoFacts).
WAN = single_diffusion_stage(
    "wan",
    "WanPipeline",
    class_names=("WanPipeline",),
    model_types=("wan",),
    description="Wan2.2 text-to-video (TI2V-5B: text or image to video): one diffusion stage",
    emits="video",
)
# Wan2.2 I2V-A14B: every request carries its source image (`input_reference` on /v1/videos).
WAN_I2V = dataclasses.replace(
    single_diffusion_stage(
        "wan_i2v",
        "WanImageToVideoPipeline",
        class_names=("WanImageToVideoPipeline",),
        description="Wan2.2 image-to-video: one diffusion stage, one source image per video",
        emits="video",
    ),
    max_input_images=1,
    requires_input_image=True,
)
# The fallback: any diffusers model_index.json; its `_class_name` picks the pipeline class.
GENERIC_DIFFUSERS = single_diffusion_stage(
    "diffusers",
    None,
    granularity=8,
    description="any diffusers text-to-image pipeline, run whole",
)
