"""Z-Image-Turbo (diffusers ZImagePipeline) as batched phases.

Math follows diffusers 0.42 `pipeline_z_image.py` with `guidance_scale=0` (Turbo's setting):
the prompt in the tokenizer's chat template, the text encoder's second-to-last hidden states of
its own tokens (padding dropped, so each prompt keeps its own length), float32 noise latents
drawn with the request's generator, linear sigmas through the scheduler (`mu` passed as diffusers
does), the timestep given to the transformer as `(1000 - t) / 1000`, the negated prediction as
the flow velocity, and the FLUX.1-style VAE un-scaling before decode.

The transformer takes lists (one latent and one caption per row) and pads each row itself, so
prompts of different lengths share a forward without padding here.

CFG: Z-Image-Turbo is distilled to run without it (diffusers' CFG runs only when
guidance_scale > 0); guidance_scale and negative_prompt are refused, never ignored. CFG for the
undistilled Z-Image is not served yet.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from ...common.knobs import FAMILY_KNOBS, CfgFacts
from ..request import RequestState
from .base import DiffusionAdapter, FamilySpec, check_flow_match_scheduler, split_images

MAX_SEQUENCE_LENGTH = 512
NO_CFG = (
    "Z-Image-Turbo runs without CFG (diffusers' guidance_scale=0); CFG for the undistilled "
    "Z-Image is not served"
)


class ZImageAdapter(DiffusionAdapter):
    pipeline_class = "ZImagePipeline"
    family = "Z-Image"
    knobs = FAMILY_KNOBS["Z-Image"]
    unsupported = {"guidance_scale": NO_CFG, "negative_prompt": NO_CFG}  # noqa: RUF012 - read only
    # LoRA: every linear of the main layers, the two refiners, the timestep embedder and the
    # final layer, whose inputs have one row per image. Not the patch and caption embedders
    # (`all_x_embedder`, `cap_embedder`): they take every image's tokens concatenated in one
    # row, so one request's adapter cannot be told from another's there (refused, not ignored).
    lora_targets = ("layers", "noise_refiner", "context_refiner", "t_embedder", "all_final_layer")

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        check_flow_match_scheduler(pipe.scheduler)
        self.vae_scale_factor = pipe.vae_scale_factor

    @property
    def spec(self) -> FamilySpec:
        g = self.vae_scale_factor * 2
        # diffusers' defaults: 1024x1024, 50 steps; guidance 0 is Turbo's (no CFG here).
        return FamilySpec(g, 1024, 1024, 50, 0.0, g, 2048)

    def cfg_facts(self) -> CfgFacts | None:
        return None  # no CFG: guidance_scale and negative_prompt are `unsupported`

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        cfg = self.pipe.transformer.config
        g = self.vae_scale_factor * 2
        tokens = (height // g) * (width // g) + MAX_SEQUENCE_LENGTH
        return tokens, int(cfg.dim), int(cfg.n_heads)

    # ---- prepare -----------------------------------------------------------------------
    def prepare(self, states: list[RequestState]) -> None:
        # One text-encoder call; diffusers returns each prompt's own (unpadded) tokens.
        # (A copy: `_encode_prompt` rewrites its list in place with the templated prompts.)
        embeds = self.pipe._encode_prompt(
            [s.req.prompt for s in states], self.device, max_sequence_length=MAX_SEQUENCE_LENGTH
        )
        channels = self.pipe.transformer.in_channels
        for s, emb in zip(states, embeds, strict=True):
            s.cond["embeds"] = emb
            h = 2 * (s.req.height // (self.vae_scale_factor * 2))
            w = 2 * (s.req.width // (self.vae_scale_factor * 2))
            s.latents = randn_tensor(
                (s.n, channels, h, w),
                generator=s.generator,
                device=self.device,
                dtype=torch.float32,
            )
            self._schedule(s, (h // 2) * (w // 2))

    def _schedule(self, s: RequestState, image_seq_len: int) -> None:
        sched = self.pipe.scheduler
        mu = calculate_shift(
            image_seq_len,
            sched.config.get("base_image_seq_len", 256),
            sched.config.get("max_image_seq_len", 4096),
            sched.config.get("base_shift", 0.5),
            sched.config.get("max_shift", 1.15),
        )
        steps = s.total_steps
        sigmas = np.linspace(1.0, 1 / steps, steps).tolist()
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=sigmas, mu=mu)
        self.set_schedule(s, timesteps)

    # ---- denoise -----------------------------------------------------------------------
    def denoise(self, states: list[RequestState]) -> None:
        dtype = self.pipe.transformer.dtype
        latents, captions, times = [], [], []
        for s in states:
            latents.extend(s.latents.to(dtype).unsqueeze(2).unbind(0))
            captions.extend([s.cond["embeds"]] * s.n)
            times.append(((1000 - s.timesteps[s.step]) / 1000).expand(s.n))
        kwargs = dict(x=latents, t=torch.cat(times), cap_feats=captions, return_dict=False)
        tags = [(s, "cond", s.n) for s in states]
        out = self.run_transformer(self.transformer, tags, kwargs)[0]
        # diffusers: the model predicts the negative flow velocity, in float32.
        velocity = -torch.stack([o.float() for o in out]).squeeze(2)
        self.euler_update(states, velocity)

    # ---- decode ------------------------------------------------------------------------
    def decode(self, states: list[RequestState]) -> list[list[Image.Image]]:
        vae = self.pipe.vae
        latents = torch.cat([s.latents for s in states]).to(vae.dtype)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return split_images(self.postprocess(image), states)
