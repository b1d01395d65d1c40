"""FLUX.1 (diffusers FluxPipeline) as batched phases.

Math follows diffusers 0.42 `pipeline_flux.py`: CLIP pooled + T5 (padded to 512) prompt
embeddings, packed 2x2 latents drawn with the request's own generator, linear sigmas with the
image-length dependent `mu` shift, embedded guidance (FLUX.1-dev) and optional true CFG
(`true_cfg_scale`, the request's or the stage default's, plus a negative prompt), unpack + VAE
decode.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from ...common.knobs import FAMILY_KNOBS, CfgFacts
from ..errors import DiffusionEngineError
from ..request import GenerationRequest, RequestState
from .base import DiffusionAdapter, FamilySpec, check_flow_match_scheduler, split_images

MAX_SEQUENCE_LENGTH = 512


class FluxAdapter(DiffusionAdapter):
    pipeline_class = "FluxPipeline"
    family = "FLUX"
    knobs = FAMILY_KNOBS["FLUX"]
    # Every linear of the blocks and the embedders / output projection around them (the modules
    # diffusers' FLUX LoRAs adapt).
    lora_targets = (
        "transformer_blocks",
        "single_transformer_blocks",
        "x_embedder",
        "context_embedder",
        "time_text_embed",
        "norm_out",
        "proj_out",
    )

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        check_flow_match_scheduler(pipe.scheduler)
        self.vae_scale_factor = pipe.vae_scale_factor
        self.guidance_distilled = bool(pipe.transformer.config.guidance_embeds)
        self.true_cfg_scale = float(self.defaults.get("true_cfg_scale", 1.0))
        if self.defaults.get("guidance_scale") is not None and not self.guidance_distilled:
            raise DiffusionEngineError(  # what a request's guidance_scale gets (cfg_facts)
                "default_sampling_params.guidance_scale: this transformer is not "
                "guidance-distilled (guidance_embeds false): diffusers ignores guidance_scale; "
                "true CFG is true_cfg_scale with a negative_prompt"
            )
        self._image_ids: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def spec(self) -> FamilySpec:
        g = self.vae_scale_factor * 2
        size = self.pipe.default_sample_size * self.vae_scale_factor
        return FamilySpec(g, size, size, 28, 3.5, g, 2048)

    def cfg_scale(self, req: GenerationRequest) -> float:
        """diffusers' true_cfg_scale: the request's, else the stage default's (1.0)."""
        return float(req.knobs.get("true_cfg_scale", self.true_cfg_scale))

    def uses_cfg(self, req: GenerationRequest) -> bool:
        # diffusers: true CFG iff true_cfg_scale > 1 and a negative prompt is given.
        return self.cfg_scale(req) > 1 and req.negative_prompt is not None

    def cfg_facts(self) -> CfgFacts:
        """True CFG with true_cfg_scale (default: the stage's, else diffusers' 1.0: off);
        guidance_scale is the embedded guidance, read only by guidance-distilled checkpoints."""
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
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        return embeds, pooled

    def prepare(self, states: list[RequestState]) -> None:
        embeds, pooled = self._encode([s.req.prompt for s in states])
        cfg_states = [s for s in states if s.do_cfg]
        if cfg_states:
            neg, neg_pooled = self._encode([s.req.negative_prompt or "" for s in cfg_states])
            for i, s in enumerate(cfg_states):
                s.cond["neg"], s.cond["neg_pooled"] = neg[i : i + 1], neg_pooled[i : i + 1]
        channels = self.pipe.transformer.config.in_channels // 4
        for i, s in enumerate(states):
            s.cond["embeds"], s.cond["pooled"] = embeds[i : i + 1], pooled[i : i + 1]
            h = 2 * (s.req.height // (self.vae_scale_factor * 2))
            w = 2 * (s.req.width // (self.vae_scale_factor * 2))
            noise = randn_tensor(
                (s.n, channels, h, w), generator=s.generator, device=self.device, dtype=embeds.dtype
            )
            s.latents = self.pipe._pack_latents(noise, s.n, channels, h, w)
            self._schedule(s)

    def _schedule(self, s: RequestState) -> None:
        steps = s.total_steps
        sched = self.pipe.scheduler
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(sched.config, "use_flow_sigmas", False):
            sigmas = None
        mu = calculate_shift(
            s.latents.shape[1],
            sched.config.get("base_image_seq_len", 256),
            sched.config.get("max_image_seq_len", 4096),
            sched.config.get("base_shift", 0.5),
            sched.config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=sigmas, mu=mu)
        self.set_schedule(s, timesteps)

    # ---- denoise -----------------------------------------------------------------------
    def _image_ids_for(self, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        key = (height, width)
        if key not in self._image_ids:
            h = 2 * (height // (self.vae_scale_factor * 2))
            w = 2 * (width // (self.vae_scale_factor * 2))
            ids = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, dtype)
            self._image_ids[key] = ids
        return self._image_ids[key]

    def denoise(self, states: list[RequestState]) -> None:
        cfg_states = [s for s in states if s.do_cfg]
        latents = torch.cat([s.latents for s in states] + [s.latents for s in cfg_states])
        rows = states + cfg_states  # cond rows for all, then uncond rows for CFG requests

        def per_row(values: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(
                [v.expand(s.n, *v.shape[1:]) for v, s in zip(values, rows, strict=True)]
            )

        embeds = per_row([s.cond["embeds"] for s in states] + [s.cond["neg"] for s in cfg_states])
        pooled = per_row(
            [s.cond["pooled"] for s in states] + [s.cond["neg_pooled"] for s in cfg_states]
        )
        t = per_row([s.timesteps[s.step].reshape(1) for s in rows]).to(latents.dtype)
        guidance = None
        if self.guidance_distilled:
            g = [
                torch.full([1], s.req.guidance_scale, dtype=torch.float32, device=self.device)
                for s in rows
            ]
            guidance = per_row(g)
        text_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self._text_ids_dtype())
        img_ids = self._img_ids(states)
        hidden = self._hidden_states(rows, latents)
        kwargs = dict(
            hidden_states=hidden,
            timestep=t / 1000,
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=text_ids,
            img_ids=img_ids,
            joint_attention_kwargs={},
            return_dict=False,
        )
        # keep_tokens: the noisy latents' part only (Kontext appends its source image's)
        noise = self.run_guided(
            self.transformer, states, kwargs, self._guide, keep_tokens=latents.shape[1]
        )
        self.euler_update(states, torch.cat(noise))

    def _hidden_states(self, rows: list[RequestState], latents: torch.Tensor) -> torch.Tensor:
        """The transformer's image sequence of the rows: here their noisy latents alone."""
        return latents

    def _img_ids(self, states: list[RequestState]) -> torch.Tensor:
        """RoPE ids of one row's image sequence (shared by the batch: same `batch_key`)."""
        req0 = states[0].req
        return self._image_ids_for(req0.height, req0.width, self._text_ids_dtype())

    def _guide(self, s: RequestState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """diffusers' true CFG (no rescale)."""
        return uncond + self.cfg_scale(s.req) * (cond - uncond)

    def _text_ids_dtype(self) -> torch.dtype:
        te = self.pipe.text_encoder
        return te.dtype if te is not None else self.pipe.transformer.dtype

    # ---- decode ------------------------------------------------------------------------
    def decode(self, states: list[RequestState]) -> list[list[Image.Image]]:
        req0 = states[0].req
        latents = torch.cat([s.latents for s in states])
        latents = self.pipe._unpack_latents(latents, req0.height, req0.width, self.vae_scale_factor)
        vae = self.pipe.vae
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return split_images(self.postprocess(image), states)
