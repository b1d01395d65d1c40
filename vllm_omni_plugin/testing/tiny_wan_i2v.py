"""Tiny random-weight Wan2.2 image-to-video checkpoint in the hub layout of
`Wan-AI/Wan2.2-I2V-A14B-Diffusers`.

Folder (written by `WanImageToVideoPipeline.save_pretrained`, as on the hub)::

    model_index.json   WanImageToVideoPipeline, boundary_ratio 0.9, no image encoder (Wan2.2
                       conditions on the source image's latents only)
    text_encoder/      UMT5EncoderModel (d_model 32)
    tokenizer/         T5TokenizerFast
    transformer/       WanTransformer3DModel, high-noise expert: 36 input channels (16 noisy
                       latents + 4 first-frame mask + 16 condition latents), 16 out
    transformer_2/     the low-noise expert (same shape, other weights)
    vae/               AutoencoderKLWan (z_dim 16, spatial scale 8, temporal scale 4)
    scheduler/         UniPCMultistepScheduler, flow prediction, flow_shift 5

Same seed -> identical weight files.
"""

from __future__ import annotations

from pathlib import Path

from vllm_omni_plugin.testing.tiny_wan import expert, save, scheduler, text_parts, wan21_vae

# Wan2.2 I2V-A14B's expert switch (its model_index.json) and its scheduler's shift.
BOUNDARY_RATIO = 0.9
FLOW_SHIFT = 5.0


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import WanImageToVideoPipeline

    tokenizer, text_encoder = text_parts(seed)
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=wan21_vae(seed + 3),
        scheduler=scheduler(FLOW_SHIFT),
        image_processor=None,
        image_encoder=None,
        transformer=expert(seed + 1, in_channels=36),
        transformer_2=expert(seed + 2, in_channels=36),
        boundary_ratio=BOUNDARY_RATIO,
    )
    return save(pipe, out_dir)
