"""GLM-Image: an AR stage on vLLM writes image tokens, a DiT stage paints."""

from __future__ import annotations

from vllm_omni_plugin.families.glm_image import LOGITS_PROCESSOR
from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec

GLM_IMAGE = PipelineTopology(
    key="glm_image",
    stages=(
        StageSpec(
            stage_id=0,
            name="ar",
            kind="ar",
            inputs=[],
            emits="token_ids",
            final_output=False,
            # The AR weights live in a subfolder; its tokenizer is the processor's, not the
            # ByT5 one in tokenizer/ (that one belongs to the DiT's glyph encoder).
            model_subdir="vision_language_encoder",
            tokenizer_subdir="processor",
            hf_architecture="GlmImageForConditionalGeneration",
            # Exact image-grid budget per request (random or unlucky weights cannot hand the
            # DiT an out-of-range id or a short grid) and generation_config parity.
            logits_processors=(LOGITS_PROCESSOR,),
        ),
        StageSpec(
            stage_id=1,
            name="dit",
            kind="diffusion",
            inputs=[0],
            emits="image",
            final_output=True,
            pipeline_class="GlmImagePipeline",
        ),
    ),
    diffusers_class_names=("GlmImagePipeline",),
    hf_model_types=("glm_image",),
    hf_architectures=("GlmImageForConditionalGeneration", "GlmImagePipeline"),
    # VAE scale 8 x DiT patch 2 x the AR grid's 2x upsampling.
    size_granularity=32,
    # Edits: one source image, tokenized by the AR's vision tokenizer and conditioning the DiT.
    max_input_images=1,
    max_input_aspect_ratio=4.0,  # the vision tokenizer's (GlmImageProcessor's) own bound
    description="GLM-Image: AR (vLLM) -> DiT (diffusion)",
)
