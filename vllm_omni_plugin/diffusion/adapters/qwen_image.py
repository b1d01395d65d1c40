"""Qwen-Image (diffusers QwenImagePipeline) as batched phases.

Math follows diffusers 0.42 `pipeline_qwenimage.py`: Qwen2.5-VL hidden states of the templated
prompt (template tokens dropped, each prompt keeps its own length), packed latents drawn with the
request's generator, `mu`-shifted linear sigmas, true CFG with the norm rescale (diffusers'
rule: on when `true_cfg_scale` > 1 and a negative prompt is given; `guidance_scale` is only the
embedded guidance of a guidance-distilled transformer, as in diffusers), and the
latents_mean/std un-normalisation before the (video-shaped) VAE decode.

Prompts of different lengths share a forward: rows are right-padded and the transformer gets an
`encoder_hidden_states_mask`, so padding is never attended to and each token keeps its RoPE
position (text positions do not depend on the padded length). With the rows' text lengths in
`attention_kwargs`, the attention runs per row over each prompt's unpadded tokens instead of
masked over the padded batch (qwen_image_rows.py; the projections stay batched).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from ...common.knobs import FAMILY_KNOBS, CfgFacts, ignored_guidance_default
from .. import qwen_image_rows
from ..errors import DiffusionEngineError
from ..request import GenerationRequest, RequestState
from .base import DiffusionAdapter, FamilySpec, check_flow_match_scheduler, split_images

MAX_SEQUENCE_LENGTH = 512


class QwenImageAdapter(DiffusionAdapter):
    pipeline_class = "QwenImagePipeline"
    family = "Qwen-Image"
    knobs = FAMILY_KNOBS["Qwen-Image"]
    # Every linear of the blocks and the projections around them (Qwen-Image-Edit inherits).
    lora_targets = (
        "transformer_blocks",
        "img_in",
        "txt_in",
        "time_text_embed",
        "norm_out",
        "proj_out",
    )

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        check_flow_match_scheduler(pipe.scheduler)
        self.vae_scale_factor = pipe.vae_scale_factor
        self.guidance_distilled = bool(pipe.transformer.config.guidance_embeds)
        ignored = ignored_guidance_default(self.defaults, self.guidance_distilled)
        if ignored is not None:  # the config check could not read a hub checkpoint's config
            raise DiffusionEngineError(f"default_sampling_params.guidance_scale {ignored}")
        # The stage's true CFG scale: its true_cfg_scale, else (a model without embedded
        # guidance) its guidance_scale, which the stage config maps to the family's CFG
        # argument, else diffusers' 4.0.
        default = self.defaults.get("true_cfg_scale")
        if default is None and not self.guidance_distilled:
            default = self.defaults.get("guidance_scale")
        self.true_cfg_scale = float(4.0 if default is None else default)

    @property
    def spec(self) -> FamilySpec:
        g = self.vae_scale_factor * 2
        size = self.pipe.default_sample_size * self.vae_scale_factor
        # The default guidance_scale, read only as a distilled model's embedded guidance.
        cfg = float(self.defaults.get("true_cfg_scale", 4.0))
        return FamilySpec(g, size, size, 50, cfg, g, 2048)

    def cfg_scale(self, req: GenerationRequest) -> float:
        """diffusers' true_cfg_scale: the request's, else the stage's."""
        return float(req.knobs.get("true_cfg_scale", self.true_cfg_scale))

    def uses_cfg(self, req: GenerationRequest) -> bool:
        return self.cfg_scale(req) > 1 and req.negative_prompt is not None

    def cfg_facts(self) -> CfgFacts:
        """True CFG (diffusers' rule); guidance_scale is read only by a guidance-distilled
        transformer (its embedded guidance), so a request sending it to another is refused."""
        return dataclasses.replace(
            super().cfg_facts(),
            scale_field="true_cfg_scale",
            default_scale=self.true_cfg_scale,
            needs_negative=True,
            guidance_used=self.guidance_distilled,
        )

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        return self.grid_token_geometry(
            height, width, self.vae_scale_factor * 2, MAX_SEQUENCE_LENGTH
        )

    # ---- prepare -----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """One text-encoder call for all prompts; each keeps only its own (valid) tokens."""
        embeds, mask = self.pipe._get_qwen_prompt_embeds(prompts, self.device)
        embeds = embeds[:, :MAX_SEQUENCE_LENGTH]
        lengths = mask[:, :MAX_SEQUENCE_LENGTH].sum(dim=1).tolist()
        return [embeds[i : i + 1, : int(n)] for i, n in enumerate(lengths)]

    def prepare(self, states: list[RequestState]) -> None:
        embeds = self._encode([s.req.prompt for s in states])
        cfg_states = [s for s in states if s.do_cfg]
        if cfg_states:
            negs = self._encode([s.req.negative_prompt or "" for s in cfg_states])
            for s, neg in zip(cfg_states, negs, strict=True):
                s.cond["neg"] = neg
        channels = self.pipe.transformer.config.in_channels // 4
        for s, emb in zip(states, embeds, strict=True):
            s.cond["embeds"] = emb
            self._init_latents(s, channels, emb.dtype)

    def _init_latents(self, s: RequestState, channels: int, dtype: torch.dtype) -> None:
        """Draw the request's packed noise latents with its generator; set its schedule."""
        h = 2 * (s.req.height // (self.vae_scale_factor * 2))
        w = 2 * (s.req.width // (self.vae_scale_factor * 2))
        noise = randn_tensor(
            (s.n, 1, channels, h, w), generator=s.generator, device=self.device, dtype=dtype
        )
        s.latents = self.pipe._pack_latents(noise, s.n, channels, h, w)
        self._schedule(s)

    def _schedule(self, s: RequestState) -> None:
        steps = s.total_steps
        sched = self.pipe.scheduler
        mu = calculate_shift(
            s.latents.shape[1],
            sched.config.get("base_image_seq_len", 256),
            sched.config.get("max_image_seq_len", 4096),
            sched.config.get("base_shift", 0.5),
            sched.config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=sigmas, mu=mu)
        self.set_schedule(s, timesteps)

    # ---- denoise -----------------------------------------------------------------------
    def denoise(self, states: list[RequestState]) -> None:
        cfg_states = [s for s in states if s.do_cfg]
        rows = states + cfg_states  # cond rows, then uncond rows of the CFG requests
        texts = [s.cond["embeds"] for s in states] + [s.cond["neg"] for s in cfg_states]
        longest = max(t.shape[1] for t in texts)
        embeds, masks, lengths = [], [], []
        for s, t in zip(rows, texts, strict=True):
            lengths += [t.shape[1]] * s.n
            pad = longest - t.shape[1]
            padded = torch.cat([t, t.new_zeros(1, pad, t.shape[2])], dim=1) if pad else t
            embeds.append(padded.expand(s.n, -1, -1))
            mask = torch.zeros(1, longest, dtype=torch.long, device=t.device)
            mask[:, : t.shape[1]] = 1
            masks.append(mask.expand(s.n, -1))
        # diffusers drops an all-ones mask; do the same so unpadded batches take its exact path
        # (decided from the lengths: reading the mask back would sync with the GPU every step).
        mask_t = None if all(t.shape[1] == longest for t in texts) else torch.cat(masks)
        latents = torch.cat([s.latents for s in rows])
        hidden = self._hidden_states(rows, latents)
        t = torch.cat([s.timesteps[s.step].expand(s.n) for s in rows]).to(latents.dtype)
        img_shapes = [self._img_shapes(states)] * latents.shape[0]
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.cat(
                [
                    torch.full([s.n], s.req.guidance_scale, dtype=torch.float32, device=self.device)
                    for s in rows
                ]
            )
        kwargs = dict(
            hidden_states=hidden,
            timestep=t / 1000,
            guidance=guidance,
            encoder_hidden_states_mask=mask_t,
            encoder_hidden_states=torch.cat(embeds),
            img_shapes=img_shapes,
            attention_kwargs=qwen_image_rows.attention_kwargs(self.pipe.transformer, lengths),
            return_dict=False,
        )
        # keep_tokens: the noisy latents' part only (the edit families append source images')
        noise = self.run_guided(
            self.transformer, states, kwargs, self._guide, keep_tokens=latents.shape[1]
        )
        self.euler_update(states, torch.cat(noise))

    def _hidden_states(self, rows: list[RequestState], latents: torch.Tensor) -> torch.Tensor:
        """The transformer's image sequence of the rows: here their noisy latents alone."""
        return latents

    def _img_shapes(self, states: list[RequestState]) -> list[tuple[int, int, int]]:
        """RoPE frames of one row's image sequence, (frames, height, width) in patches."""
        req0, g = states[0].req, self.vae_scale_factor * 2
        return [(1, req0.height // g, req0.width // g)]

    def _guide(self, s: RequestState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """diffusers' true CFG, rescaled to the conditioned prediction's norm."""
        comb = uncond + self.cfg_scale(s.req) * (cond - uncond)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb, dim=-1, keepdim=True)
        return comb * (cond_norm / noise_norm)

    # ---- decode ------------------------------------------------------------------------
    def decode(self, states: list[RequestState]) -> list[list[Image.Image]]:
        req0 = states[0].req
        vae = self.pipe.vae
        latents = torch.cat([s.latents for s in states])
        latents = self.pipe._unpack_latents(latents, req0.height, req0.width, self.vae_scale_factor)
        latents = latents.to(vae.dtype)
        z = vae.config.z_dim
        mean = (
            torch.tensor(vae.config.latents_mean)
            .view(1, z, 1, 1, 1)
            .to(latents.device, latents.dtype)
        )
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(
            latents.device, latents.dtype
        )
        latents = latents / std + mean
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return split_images(self.postprocess(image), states)
