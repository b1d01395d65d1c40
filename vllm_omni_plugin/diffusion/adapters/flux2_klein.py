"""FLUX.2 klein (diffusers Flux2KleinPipeline) as batched phases: text to image, and edits with
reference images.

Math follows diffusers 0.42 `pipeline_flux2_klein.py`: the chat-templated prompt through the
Qwen3 text encoder, hidden states 9, 18 and 27 stacked per token (padded to 512 tokens, as
diffusers attends to the padding too), noise drawn with the request's generator at
(n, 4C, H/16, W/16) and packed to tokens, the empirical `mu` of the step count and image length,
linear sigmas, CFG with the empty prompt as the negative (on when guidance_scale > 1 and the
checkpoint is not step-distilled: `is_distilled` in model_index.json), and the VAE's batch-norm
un-normalisation and 2x2 un-patchify before decode.

Edits: each reference image is checked as diffusers checks it, shrunk to 1 MP when larger,
cropped to a multiple of 16, VAE encoded (the latent mode: the generator is not drawn from),
normalised, packed and appended after the noisy tokens with its own time coordinate (10, 20,
...); only the noisy tokens' prediction is used. The output size is the request's (the edits
route fills it from the first image's aspect ratio), not the last reference image's size as in
diffusers when height/width are unset.

Step batching: requests share a forward when they have the same output size, the same
reference image sizes and the same CFG use (`batch_key`); CFG's empty-prompt rows join the same
forward. Prompts are encoded once for all newly admitted requests; the empty prompt once per
engine.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from ...common.knobs import FAMILY_KNOBS, CfgFacts
from ..errors import RequestValidationError
from ..request import GenerationRequest, RequestState
from .base import DiffusionAdapter, FamilySpec, check_flow_match_scheduler, split_images

MAX_SEQUENCE_LENGTH = 512
REFERENCE_PIXELS = 1024 * 1024  # diffusers shrinks larger reference images to this area
NO_NEGATIVE = "FLUX.2 klein's CFG always uses the empty prompt (diffusers takes no negative prompt)"
DISTILLED = "this FLUX.2 klein checkpoint is step-distilled: diffusers ignores guidance_scale"


class Flux2KleinAdapter(DiffusionAdapter):
    pipeline_class = "Flux2KleinPipeline"
    family = "FLUX.2-klein"
    # LoRA: every linear of the blocks and the embedders / output projection around them.
    lora_targets = (
        "transformer_blocks",
        "single_transformer_blocks",
        "x_embedder",
        "context_embedder",
        "proj_out",
    )
    knobs = FAMILY_KNOBS["FLUX.2-klein"]
    # Reference images per edit: diffusers sets no limit; each adds its tokens to every step.
    max_input_images: ClassVar[int] = 4

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        check_flow_match_scheduler(pipe.scheduler)
        self.vae_scale_factor = pipe.vae_scale_factor
        self.distilled = bool(pipe.config.is_distilled)
        self.unsupported = {"negative_prompt": NO_NEGATIVE}
        if self.distilled:
            self.unsupported["guidance_scale"] = DISTILLED
        self._empty: torch.Tensor | None = None  # the empty prompt's embeddings (CFG)
        self._text_ids: torch.Tensor | None = None

    @property
    def spec(self) -> FamilySpec:
        g = self.vae_scale_factor * 2
        size = self.pipe.default_sample_size * self.vae_scale_factor
        return FamilySpec(g, size, size, 50, 4.0, g, 2048)

    def uses_cfg(self, req: GenerationRequest) -> bool:
        return not self.distilled and (req.guidance_scale or 0) > 1

    def cfg_facts(self) -> CfgFacts | None:
        """CFG when guidance_scale > 1, against the empty prompt (no negative_prompt field);
        none for step-distilled checkpoints (guidance_scale refused there)."""
        if self.distilled:
            return None
        return super().cfg_facts()

    def check_request(self, req: GenerationRequest) -> None:
        for image in req.input_images:
            try:
                self.pipe.image_processor.check_image_input(image)
            except ValueError as exc:
                raise RequestValidationError("image", str(exc)) from None

    def reference_size(self, image: Image.Image) -> tuple[int, int]:
        """(height, width) a reference image is encoded at, as diffusers computes it."""
        width, height = image.size
        if width * height > REFERENCE_PIXELS:
            scale = (REFERENCE_PIXELS / (width * height)) ** 0.5
            width, height = int(width * scale), int(height * scale)
        g = self.vae_scale_factor * 2
        return (height // g) * g, (width // g) * g

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        return self.grid_token_geometry(
            height, width, self.vae_scale_factor * 2, MAX_SEQUENCE_LENGTH
        )

    def batch_key(self, state: RequestState):
        refs = tuple(self.reference_size(im) for im in state.req.input_images)
        return (state.req.height, state.req.width, state.do_cfg, refs)

    # ---- prepare -----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> torch.Tensor:
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=MAX_SEQUENCE_LENGTH
        )
        return embeds

    def prepare(self, states: list[RequestState]) -> None:
        embeds = self._encode([s.req.prompt for s in states])
        if self._text_ids is None:
            self._text_ids = self.pipe._prepare_text_ids(embeds[:1]).to(self.device)
        if any(s.do_cfg for s in states) and self._empty is None:
            self._empty = self._encode([""])
        channels = self.pipe.transformer.config.in_channels // 4
        g = self.vae_scale_factor * 2
        for i, s in enumerate(states):
            s.cond["embeds"] = embeds[i : i + 1]
            h, w = 2 * (s.req.height // g), 2 * (s.req.width // g)
            noise = randn_tensor(
                (s.n, channels * 4, h // 2, w // 2),
                generator=s.generator,
                device=self.device,
                dtype=embeds.dtype,
            )
            s.cond["latent_ids"] = self.pipe._prepare_latent_ids(noise[:1]).to(self.device)
            s.latents = self.pipe._pack_latents(noise)
            self._references(s)
            self._schedule(s)

    def _references(self, s: RequestState) -> None:
        """The request's reference images as packed latents and their position ids."""
        if not s.req.input_images:
            s.cond["img_ids"] = s.cond["latent_ids"]
            return
        proc, vae = self.pipe.image_processor, self.pipe.vae
        latents = []
        for image in s.req.input_images:
            height, width = self.reference_size(image)
            if image.size[0] * image.size[1] > REFERENCE_PIXELS:
                image = proc._resize_to_target_area(image, REFERENCE_PIXELS)
            pixels = proc.preprocess(image, height=height, width=width, resize_mode="crop")
            pixels = pixels.to(self.device, vae.dtype)
            latents.append(self.pipe._encode_vae_image(image=pixels, generator=s.generator))
        ref_ids = self.pipe._prepare_image_ids(latents).to(self.device)
        packed = torch.cat([self.pipe._pack_latents(x).squeeze(0) for x in latents])
        s.cond["ref_latents"] = packed.unsqueeze(0).expand(s.n, -1, -1)
        s.cond["img_ids"] = torch.cat([s.cond["latent_ids"], ref_ids], dim=1)

    def _schedule(self, s: RequestState) -> None:
        steps = s.total_steps
        sched = self.pipe.scheduler
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(sched.config, "use_flow_sigmas", False):
            sigmas = None
        mu = compute_empirical_mu(image_seq_len=s.latents.shape[1], num_steps=steps)
        timesteps, _ = retrieve_timesteps(sched, steps, self.device, sigmas=sigmas, mu=mu)
        self.set_schedule(s, timesteps)

    # ---- denoise -----------------------------------------------------------------------
    def denoise(self, states: list[RequestState]) -> None:
        cfg_states = [s for s in states if s.do_cfg]
        rows = states + cfg_states  # cond rows for all, then the CFG requests' empty-prompt rows
        dtype = self.pipe.transformer.dtype
        hidden = []
        for s in rows:
            x = s.latents
            if "ref_latents" in s.cond:
                x = torch.cat([x, s.cond["ref_latents"]], dim=1)
            hidden.append(x.to(dtype))
        texts = [s.cond["embeds"] for s in states] + [self._empty] * len(cfg_states)
        embeds = torch.cat([t.expand(s.n, -1, -1) for t, s in zip(texts, rows, strict=True)])
        t = torch.cat([s.timesteps[s.step].expand(s.n) for s in rows]).to(states[0].latents.dtype)
        kwargs = dict(
            hidden_states=torch.cat(hidden),
            timestep=t / 1000,
            guidance=None,
            encoder_hidden_states=embeds,
            txt_ids=self._text_ids,
            img_ids=states[0].cond["img_ids"],  # equal within a batch (batch_key)
            joint_attention_kwargs=None,
            return_dict=False,
        )
        noise = self.run_guided(
            self.transformer,
            states,
            kwargs,
            self._guide,
            keep_tokens=states[0].latents.shape[1],  # the noisy tokens' part only
        )
        self.euler_update(states, torch.cat(noise))

    def _guide(self, s: RequestState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """diffusers' CFG against the empty prompt, at the request's guidance_scale."""
        return uncond + s.req.guidance_scale * (cond - uncond)

    # ---- decode ------------------------------------------------------------------------
    def decode(self, states: list[RequestState]) -> list[list[Image.Image]]:
        req0, vae = states[0].req, self.pipe.vae
        g = self.vae_scale_factor * 2
        latents = torch.cat([s.latents for s in states])
        ids = states[0].cond["latent_ids"].expand(latents.shape[0], -1, -1)
        latents = self.pipe._unpack_latents_with_ids(
            latents, ids, req0.height // g, req0.width // g
        )
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        latents = latents * std.to(latents.device, latents.dtype) + mean
        latents = self.pipe._unpatchify_latents(latents)
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return split_images(self.postprocess(image), states)
