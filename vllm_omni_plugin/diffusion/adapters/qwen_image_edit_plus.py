"""Qwen-Image-Edit-2509 / 2511 (diffusers QwenImageEditPlusPipeline) as batched phases.

Math follows diffusers 0.42 `pipeline_qwenimage_edit_plus.py`. A request carries 1 to
`max_input_images` source images. Each is resized twice at its own aspect ratio (multiples of
32): to `condition_pixels` (384x384 in diffusers) for the Qwen2.5-VL text encoder, where the
prompt becomes "Picture 1: <image> Picture 2: <image> ... {prompt}" inside the edit template,
and to `vae_pixels` (1024x1024) for the VAE, whose latents (the mode, no noise drawn),
normalised and packed, follow the noisy latents in the transformer's sequence in upload order,
each with its own RoPE frame (`img_shapes`: the output, then one entry per image). Only the
noisy latents' part of the prediction is used. Sigmas, true CFG with the norm rescale, the Euler
step and the decode are Qwen-Image's. Qwen-Image-Edit-2511's transformer (`zero_cond_t`: the
source images' tokens modulated at timestep 0) runs through the same code: the transformer
derives that from `img_shapes`.

diffusers' pipeline takes one prompt per call; here the text encoder runs once for all newly
admitted requests (each with its own images, right-padded with the attention mask), and
requests share a denoising forward when they have the same output size, CFG use and source
image sizes (`batch_key`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    calculate_dimensions,
)

from ...common.knobs import FAMILY_KNOBS
from ..request import GenerationRequest, RequestState
from .qwen_image_edit import QwenImageEditAdapter

# How diffusers names each source image inside the prompt (`_get_qwen_prompt_embeds`).
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    pipeline_class = "QwenImageEditPlusPipeline"
    family = "Qwen-Image-Edit-Plus"
    knobs = FAMILY_KNOBS["Qwen-Image-Edit-Plus"]
    # The most source images one edit takes (the model card's best results are with 1 to 3).
    max_input_images: ClassVar[int] = 4
    condition_pixels: ClassVar[int] = CONDITION_IMAGE_SIZE  # what the text encoder sees
    vae_pixels: ClassVar[int] = VAE_IMAGE_SIZE  # what the transformer sees

    def check_request(self, req: GenerationRequest) -> None:
        return None  # the engine checks the count against max_input_images

    def _size_at(self, image, area: int) -> tuple[int, int]:
        w, h = image.size
        cw, ch = calculate_dimensions(area, w / h)
        return int(ch), int(cw)

    def vae_sizes(self, req: GenerationRequest) -> tuple[tuple[int, int], ...]:
        """(height, width) of each source image as the VAE encodes it."""
        return tuple(self._size_at(im, self.vae_pixels) for im in req.input_images)

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        tokens, inner, heads = super(QwenImageEditAdapter, self).token_geometry(height, width)
        per_image = self.vae_pixels // 256 + self.condition_pixels // 784  # latents + VL tokens
        return tokens + self.max_input_images * per_image, inner, heads

    def batch_key(self, state: RequestState):
        req = state.req
        return (req.height, req.width, state.do_cfg, self.vae_sizes(req))

    # ---- prepare -----------------------------------------------------------------------
    def _encode_with_images(self, prompts: list[str], images: list[list]) -> list[torch.Tensor]:
        """One text-encoder call for all (prompt, images) pairs, diffusers' template per row;
        each row keeps its own valid tokens after the template prefix."""
        pipe = self.pipe
        texts = [
            pipe.prompt_template_encode.format(
                "".join(PICTURE.format(i + 1) for i in range(len(ims))) + prompt
            )
            for prompt, ims in zip(prompts, images, strict=True)
        ]
        flat = [im for ims in images for im in ims]
        inputs = pipe.processor(text=texts, images=flat, padding=True, return_tensors="pt").to(
            self.device
        )
        hidden = pipe.text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            output_hidden_states=True,
        ).hidden_states[-1]
        drop = pipe.prompt_template_encode_start_idx
        out = []
        for row, mask in zip(hidden, inputs["attention_mask"].bool(), strict=True):
            out.append(row[mask][drop:].unsqueeze(0).to(pipe.text_encoder.dtype))
        return out

    def prepare(self, states: list[RequestState]) -> None:
        proc = self.pipe.image_processor
        prompt_images = [
            [
                proc.resize(im, *self._size_at(im, self.condition_pixels))
                for im in s.req.input_images
            ]
            for s in states
        ]
        embeds = self._encode_prompts(states, prompt_images)
        channels = self.pipe.transformer.config.in_channels // 4
        for s, emb in zip(states, embeds, strict=True):
            s.cond["embeds"] = emb
            s.cond["vae_hw"] = self.vae_sizes(s.req)
            packed = [
                self._packed_image_latents(im, vh, vw, s, emb.dtype)
                for im, (vh, vw) in zip(s.req.input_images, s.cond["vae_hw"], strict=True)
            ]
            s.cond["image_latents"] = torch.cat(packed, dim=1).expand(s.n, -1, -1)
            self._init_latents(s, channels, emb.dtype)

    # ---- denoise: the parent's `_hidden_states` appends `image_latents` ----------------
    def _img_shapes(self, states: list[RequestState]) -> list[tuple[int, int, int]]:
        """The output frame, then each source image's own RoPE frame, in upload order."""
        g = self.vae_scale_factor * 2
        frames = [(1, vh // g, vw // g) for vh, vw in states[0].cond["vae_hw"]]
        return [*super(QwenImageEditAdapter, self)._img_shapes(states), *frames]
