"""FLUX.1-Kontext (diffusers FluxKontextPipeline) as batched phases.

Math follows diffusers 0.42 `pipeline_flux_kontext.py`. The source image is resized to the
Kontext training resolution nearest its aspect ratio (`PREFERRED_KONTEXT_RESOLUTIONS`, about
1 MP, diffusers' `_auto_resize`), VAE encoded (the latent mode: no noise drawn), shifted and
scaled, packed 2x2 and appended after the noisy latents in the transformer's sequence; its RoPE
ids are the latent grid's with the first axis set to 1. Only the noisy latents' part of the
prediction is used. Prompt encoding (CLIP pooled + T5), sigmas, embedded guidance, true CFG,
the Euler step and the decode are FLUX.1's (the parent adapter).

The output has exactly the requested size: diffusers rescales `height` x `width` to `max_area`
at the same aspect ratio, which leaves a size on the 16-pixel grid unchanged when `max_area` is
`height * width` (the tests call it so).

Without a source image a request is FLUX.1 text-to-image (diffusers allows `image=None`).
Step batching: requests share a forward when they have the same output size, CFG use and
condition size (`batch_key`): the RoPE ids are one tensor for the whole batch.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from ...common.knobs import FAMILY_KNOBS
from ..request import RequestState
from .flux import FluxAdapter


class FluxKontextAdapter(FluxAdapter):
    pipeline_class = "FluxKontextPipeline"
    family = "FLUX.1-Kontext"
    knobs = FAMILY_KNOBS["FLUX.1-Kontext"]
    max_input_images: ClassVar[int] = 1
    # (width, height) the source image may be resized to: diffusers' list (about 1 MP each).
    resolutions: ClassVar[tuple[tuple[int, int], ...]] = tuple(PREFERRED_KONTEXT_RESOLUTIONS)

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        self._cond_ids: dict[tuple, torch.Tensor] = {}

    def condition_size(self, image) -> tuple[int, int]:
        """(height, width) the source image is resized to, as diffusers computes it: its size
        on the 16-pixel grid, then the preferred resolution nearest that aspect ratio."""
        height, width = self.pipe.image_processor.get_default_height_width(image)
        ratio = width / height
        _, w, h = min((abs(ratio - rw / rh), rw, rh) for rw, rh in self.resolutions)
        g = self.vae_scale_factor * 2
        return h // g * g, w // g * g

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        tokens, inner, heads = super().token_geometry(height, width)
        g = self.vae_scale_factor * 2
        most = max(w * h for w, h in self.resolutions) // (g * g)
        return tokens + most, inner, heads  # the largest condition image's latents

    def batch_key(self, state: RequestState):
        images = state.req.input_images
        cond_hw = self.condition_size(images[0]) if images else None
        return (state.req.height, state.req.width, state.do_cfg, cond_hw)

    # ---- prepare -----------------------------------------------------------------------
    def prepare(self, states: list[RequestState]) -> None:
        super().prepare(states)  # prompts, noise latents (the same draws) and schedules
        proc = self.pipe.image_processor
        channels = self.pipe.transformer.config.in_channels // 4
        for s in states:
            if not s.req.input_images:
                continue
            ch, cw = self.condition_size(s.req.input_images[0])
            image = proc.resize(s.req.input_images[0], ch, cw)
            pixels = proc.preprocess(image, ch, cw).to(self.device, s.latents.dtype)
            # argmax: the latent mode, so the generator is not drawn from (as in diffusers).
            latents = self.pipe._encode_vae_image(pixels, s.generator)
            lh, lw = latents.shape[2:]
            packed = self.pipe._pack_latents(latents, 1, channels, lh, lw)
            s.cond["image_latents"] = packed.expand(s.n, -1, -1)
            s.cond["cond_hw"] = (ch, cw)

    # ---- denoise (FLUX.1's step; these two hooks add the source image) ------------------
    def _hidden_states(self, rows: list[RequestState], latents: torch.Tensor) -> torch.Tensor:
        if "image_latents" not in rows[0].cond:
            return latents
        return torch.cat(
            [torch.cat([s.latents, s.cond["image_latents"]], dim=1) for s in rows], dim=0
        )

    def _img_ids(self, states: list[RequestState]) -> torch.Tensor:
        out_ids = super()._img_ids(states)
        cond_hw = states[0].cond.get("cond_hw")
        if cond_hw is None:
            return out_ids
        key = (states[0].req.height, states[0].req.width, cond_hw)
        if key not in self._cond_ids:
            g = self.vae_scale_factor * 2
            ids = self.pipe._prepare_latent_image_ids(
                1, cond_hw[0] // g, cond_hw[1] // g, self.device, out_ids.dtype
            )
            ids[..., 0] = 1  # the source image's frame (diffusers: first axis 1, not 0)
            self._cond_ids[key] = torch.cat([out_ids, ids], dim=0)
        return self._cond_ids[key]
