"""Wan2.2 image-to-video conditioning, as diffusers 0.42 `pipeline_wan_i2v.py` computes it.

Two ways a source image steers the video:

- first frame (`FIRST_FRAME`, Wan2.2 TI2V-5B: `expand_timesteps` in the pipeline config): the
  image's normalised VAE latent stands in for the first latent frame of the transformer input
  at every step, and that frame's tokens get timestep 0 (one timestep per latent token); the
  final latents get the same frame before the VAE decode.
- concatenated channels (`CONCAT`, Wan2.2 I2V-A14B): the VAE encodes a video of the image
  followed by black frames; a 4-channel first-frame mask and those latents are concatenated
  to the noisy latents along the channels (16 + 4 + 16 = 36 input channels).

The image is resized to the output size by the pipeline's VideoProcessor; the VAE encode takes
the latent mode, so the request's generator is not drawn from (as in diffusers).
"""

from __future__ import annotations

from typing import Any

import torch

FIRST_FRAME = "first_frame"
CONCAT = "concat"


def _normalised(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents)
    return (latents - mean) * inv_std


def encode_condition(
    pipe: Any, image: Any, height: int, width: int, frames: int, mode: str, device: torch.device
) -> torch.Tensor:
    """The condition tensor of one request (batch 1, float32): FIRST_FRAME: the image's latent
    frame [1, z, 1, h, w]; CONCAT: mask + latents [1, 4 + z, F', h, w]."""
    vae = pipe.vae
    pixels = pipe.video_processor.preprocess(image, height=height, width=width)
    pixels = pixels.to(device, dtype=torch.float32).unsqueeze(2)  # [1, 3, 1, H, W]
    if mode == CONCAT:
        black = pixels.new_zeros(1, pixels.shape[1], frames - 1, height, width)
        pixels = torch.cat([pixels, black], dim=2)
    encoded = vae.encode(pixels.to(device=device, dtype=vae.dtype)).latent_dist.mode()
    latents = _normalised(vae, encoded.to(device=device, dtype=torch.float32))
    if mode == FIRST_FRAME:
        return latents
    temporal = int(pipe.vae_scale_factor_temporal)
    lh, lw = latents.shape[3:]
    mask = torch.ones(1, 1, frames, lh, lw)
    mask[:, :, 1:] = 0
    # The first frame's mask repeated `temporal` times, then grouped per latent frame.
    mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
    mask = mask.view(1, -1, temporal, lh, lw).transpose(1, 2).to(latents.device)
    return torch.cat([mask, latents], dim=1)


def first_frame_mask(latents: torch.Tensor) -> torch.Tensor:
    """1 where the latents are denoised, 0 on the first latent frame (the image's)."""
    f, h, w = latents.shape[2:]
    mask = torch.ones(1, 1, f, h, w, dtype=torch.float32, device=latents.device)
    mask[:, :, 0] = 0
    return mask


def with_first_frame(latents: torch.Tensor, condition: torch.Tensor, mask: torch.Tensor):
    """`latents` with the image's latent as their first frame."""
    return (1 - mask) * condition + mask * latents


def token_timesteps(mask: torch.Tensor, t: torch.Tensor, patch: tuple[int, ...]) -> torch.Tensor:
    """One timestep per latent token [seq]: `t` where `mask` is 1, 0 on the image's frame."""
    return (mask[0][0][:, :: patch[1], :: patch[2]] * t).flatten()
