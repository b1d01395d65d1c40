"""Tiny random-weight Wan2.2 TI2V-5B checkpoint in the hub layout of
`Wan-AI/Wan2.2-TI2V-5B-Diffusers`: text-to-video, and image-to-video from the same folder.

Folder (written by `WanPipeline.save_pretrained`, as on the hub)::

    model_index.json   WanPipeline, expand_timesteps true (one timestep per latent token, so a
                       source image can stand in for the first latent frame), one expert
    text_encoder/      UMT5EncoderModel (d_model 32)
    tokenizer/         T5TokenizerFast
    transformer/       WanTransformer3DModel, 48 channels in and out (patch 1x2x2, 2 layers)
    vae/               AutoencoderKLWan in the Wan2.2 layout: z_dim 48, residual, pixel patch
                       2, spatial scale 16, temporal scale 4
    scheduler/         UniPCMultistepScheduler, flow prediction, flow_shift 5

Sizes are multiples of 32 (VAE 16 x patch 2). Same seed -> identical weight files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_omni_plugin.testing.tiny_wan import (
    expert,
    save,
    scheduler,
    text_parts,
    zero_decoder_biases,
)

FLOW_SHIFT = 5.0
Z_DIM = 48


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import AutoencoderKLWan, WanPipeline

    tokenizer, text_encoder = text_parts(seed)
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=Z_DIM,
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        latents_mean=[0.0] * Z_DIM,
        latents_std=[1.0] * Z_DIM,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        scale_factor_spatial=16,
        temperal_downsample=[False, True, True],
    )
    zero_decoder_biases(vae)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler(FLOW_SHIFT),
        transformer=expert(seed + 1, in_channels=Z_DIM, out_channels=Z_DIM),
        transformer_2=None,
        expand_timesteps=True,
    )
    return save(pipe, out_dir)
