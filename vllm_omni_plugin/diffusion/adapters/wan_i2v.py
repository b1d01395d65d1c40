"""Wan2.2 image-to-video (diffusers WanImageToVideoPipeline) as batched phases.

The Wan2.2 text-to-video adapter's math (wan.py: UMT5 prompts, per-request UniPC schedulers,
two experts split at `boundary_ratio`, CFG with `guidance_scale_2` on the low-noise expert),
plus the source image every request must carry (wan_image.py): Wan2.2 I2V-A14B concatenates
a first-frame mask and the VAE latents of the image followed by black frames to the noisy
latents; a TI2V-5B checkpoint loaded as this pipeline (`expand_timesteps`) puts the image in
the first latent frame instead.

Wan2.1's image-to-video checkpoints also condition on CLIP image embeddings
(`transformer.config.image_dim`); they are refused at load, not served without them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import WanPipeline

from ..errors import UnsupportedModelError
from . import wan_image
from .wan import MAX_SEQUENCE_LENGTH, WanAdapter


class WanImageToVideoAdapter(WanAdapter):
    pipeline_class = "WanImageToVideoPipeline"
    requires_input_image: ClassVar[bool] = True
    # Wan2.2 has no CLIP image encoder: diffusers' optional components stay unloaded.
    skip_components = ("image_encoder", "image_processor")

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        if pipe.transformer.config.image_dim is not None:
            raise UnsupportedModelError(
                "WanImageToVideoPipeline with CLIP image embeddings (Wan2.1 I2V, "
                "transformer.config.image_dim) is not supported; Wan2.2 I2V-A14B and TI2V-5B are"
            )
        self.image_mode = wan_image.FIRST_FRAME if self.expand_timesteps else wan_image.CONCAT
        self.max_input_images = 1

    def _encode(self, prompts: list[str]) -> list[torch.Tensor]:
        # WanPipeline's copy of the same UMT5 encoding: diffusers' image-to-video one calls ftfy
        # without checking that it is installed (WanPipeline's cleans with it when it is).
        embeds = WanPipeline._get_t5_prompt_embeds(
            self.pipe, prompts, max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device
        )
        dtype = self.pipe.transformer.dtype
        return [embeds[i : i + 1].to(dtype) for i in range(len(prompts))]
