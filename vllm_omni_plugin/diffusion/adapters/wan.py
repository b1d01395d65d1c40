"""Wan2.1 / Wan2.2 text-to-video (diffusers WanPipeline) as batched phases.

Math follows diffusers 0.42 `pipeline_wan.py`: UMT5 prompt embeddings zero-padded to 512
tokens (the transformer attends to the padding, as in diffusers, so rows of different prompts
stack without a mask), float32 latents drawn with the request's generator, the checkpoint's
scheduler (Wan2.2: multistep UniPC), CFG when guidance_scale > 1 with "" as the default
negative prompt, and Wan2.2's two experts: `transformer` above `boundary_ratio * 1000`,
`transformer_2` below, the latter guided by `guidance_scale_2` (default: `guidance_scale`).
Per request, as vLLM-Omni's clients send them: `guidance_scale_2`, `boundary_ratio` (diffusers
reads it from the pipeline config; a request's replaces it for that request) and `flow_shift`
(the scheduler's; a request's builds that request's scheduler with it, as
`UniPCMultistepScheduler.from_config(config, flow_shift=...)` would).

Step batching: the multistep scheduler keeps a history per sample, so every request owns a
copy of the checkpoint's scheduler; one transformer forward serves every request of a group
(cond rows, then uncond rows), then each request's scheduler steps on its own slice. The batch
key holds the expert a request's next step needs, so requests on different experts never share
a forward. A video is one request with n = 1; its decode yields its frames.

Image-to-video (wan_image.py): Wan2.2 TI2V-5B (`expand_timesteps`) takes an optional source
image as its first frame, WanImageToVideoPipeline (wan_i2v.py) a required one through
concatenated channels. Rows with and without a source image share a forward: the image only
changes a row's own input and per-token timesteps.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable
from functools import lru_cache

import torch
from diffusers import WanPipeline
from PIL import Image

from ...common.knobs import FAMILY_KNOBS, CfgFacts, Knob
from ..errors import RequestValidationError, UnsupportedModelError
from ..request import GenerationRequest, RequestState
from . import wan_image
from .base import DiffusionAdapter, FamilySpec

MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default
# diffusers' WanPipeline defaults; a stage config overrides them.
DEFAULT_NUM_FRAMES = 81


class WanAdapter(DiffusionAdapter):
    pipeline_class = "WanPipeline"
    family = "Wan2.2"
    knobs = FAMILY_KNOBS["Wan2.2"]
    # The blocks of each expert: `transformer` (Wan2.2: the high-noise expert) from the
    # adapter's file, `transformer_2` (the low-noise expert) from its `transformer_2/` file,
    # as diffusers' `load_lora_weights(..., load_into_transformer_2=True)` loads it.
    lora_targets = ("blocks",)
    lora_experts = ("transformer", "transformer_2")

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        if pipe.transformer is None:
            raise TypeError("WanPipeline without `transformer` (low-noise only) is not supported")
        self.temporal = int(pipe.vae_scale_factor_temporal)
        self.spatial = int(pipe.vae_scale_factor_spatial)
        self.patch = tuple(pipe.transformer.config.patch_size)
        ratio = pipe.config.get("boundary_ratio")
        self.boundary_ratio = ratio
        self.boundary = None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps
        self.transformer_2 = getattr(pipe, "transformer_2", None)
        if ratio is not None and self.transformer_2 is None:
            # diffusers would call the missing expert at the first step below the switch.
            raise UnsupportedModelError(
                f"WanPipeline with boundary_ratio {ratio} but no transformer_2 (the low-noise "
                "expert it switches to) is not supported"
            )
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))
        # How a source image conditions the video (None: text-to-video only).
        self.image_mode = wan_image.FIRST_FRAME if self.expand_timesteps else None
        self.max_input_images = 0 if self.image_mode is None else 1

    # ---- facts -------------------------------------------------------------------------
    def cached_models(self) -> list[torch.nn.Module]:
        experts = [self.pipe.transformer, getattr(self.pipe, "transformer_2", None)]
        return [m for m in experts if m is not None]

    @property
    def spec(self) -> FamilySpec:
        g = self.spatial * self.patch[1]
        return FamilySpec(g, 480, 832, 50, 5.0, g, 1280)

    def uses_cfg(self, req: GenerationRequest) -> bool:
        return (req.guidance_scale or 0) > 1.0

    def applied_knobs(self) -> tuple[Knob, ...]:
        """Wan2.1 (one expert) has no expert switch; flow_shift needs a scheduler that has it."""
        out = []
        for knob in self.knobs:
            if knob.name in ("guidance_scale_2", "boundary_ratio") and self.boundary is None:
                continue
            if knob.name == "flow_shift" and "flow_shift" not in self.pipe.scheduler.config:
                continue
            out.append(knob)
        return tuple(out)

    def cfg_facts(self) -> CfgFacts:
        """CFG when guidance_scale > 1 (diffusers' WanPipeline); Wan2.2's low-noise expert
        guided by guidance_scale_2."""
        facts = super().cfg_facts()
        if self.boundary is None:
            return facts
        return dataclasses.replace(
            facts, second_scale="guidance_scale_2", second_boundary=self.boundary_ratio
        )

    def _boundary(self, req: GenerationRequest) -> float | None:
        ratio = req.knobs.get("boundary_ratio")
        if ratio is None or self.boundary is None:
            return self.boundary
        return ratio * self.pipe.scheduler.config.num_train_timesteps

    def _new_scheduler(self, shift: float | None):
        """The checkpoint's scheduler, or one built from its config with the request's shift."""
        sched = self.pipe.scheduler
        if shift is None:
            return copy.deepcopy(sched)
        return type(sched).from_config(sched.config, flow_shift=shift)

    def video_facts(self) -> dict[str, int]:
        """What the API server needs to check a video request: frames are 1 + k * step."""
        return {
            "frame_step": self.temporal,
            "default_num_frames": int(self.defaults.get("num_frames", DEFAULT_NUM_FRAMES)),
            "max_input_images": self.max_input_images,
            "requires_input_image": self.requires_input_image,
        }

    def num_frames(self, req: GenerationRequest) -> int:
        frames = getattr(req, "num_frames", None)
        return int(frames if frames is not None else self.video_facts()["default_num_frames"])

    def check_request(self, req: GenerationRequest) -> None:
        if req.n != 1:
            raise RequestValidationError("n", "a video request makes one video (n = 1)")
        frames = getattr(req, "num_frames", None)
        if frames is not None and (
            isinstance(frames, bool) or not isinstance(frames, int) or frames < 1
        ):
            raise RequestValidationError(
                "num_frames", f"must be a positive integer, got {frames!r}"
            )
        frames = self.num_frames(req)
        if (frames - 1) % self.temporal:
            raise RequestValidationError(
                "num_frames", f"must be 1 + a multiple of {self.temporal}, got {frames}"
            )
        if "guidance_scale_2" in req.knobs and self.uses_cfg(req):
            # diffusers: the low-noise expert, guided by guidance_scale_2, runs the steps whose
            # timestep lies below the switch; with few steps (or a late switch) none may.
            boundary = self._boundary(req)
            timesteps = self._timesteps(req.num_inference_steps, req.knobs.get("flow_shift"))
            if boundary is None or not bool((timesteps < boundary).any()):
                raise RequestValidationError(
                    "guidance_scale_2",
                    f"has no effect: none of this request's {req.num_inference_steps} steps "
                    "reaches the low-noise expert it guides (boundary_ratio "
                    f"{req.knobs.get('boundary_ratio', self.boundary_ratio)})",
                )

    def output_frames(self, req: GenerationRequest) -> int:
        return self.num_frames(req)

    def memory_facts(self) -> dict:
        """Frames count in the plan (a latent frame per `temporal` frames after the first);
        I2V-A14B encodes its source image as a whole video of the output's frames."""
        return {
            **super().memory_facts(),
            "frame_step": self.temporal,
            "source_video": self.image_mode == wan_image.CONCAT,
        }

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        # Per latent frame (memory_facts adds the frames).
        g = self.spatial * self.patch[1]
        return self.grid_token_geometry(height, width, g, MAX_SEQUENCE_LENGTH)

    # ---- schedule ----------------------------------------------------------------------
    @lru_cache(maxsize=64)  # noqa: B019 - one adapter per engine, a handful of step counts
    def _timesteps(self, steps: int, shift: float | None = None) -> torch.Tensor:
        sched = self._new_scheduler(shift)
        sched.set_timesteps(steps, device=self.device)
        return sched.timesteps

    def _expert(self, t: torch.Tensor, req: GenerationRequest) -> int:
        """0: `transformer` (Wan2.1, or Wan2.2's high-noise expert); 1: `transformer_2`."""
        boundary = self._boundary(req)
        return 0 if boundary is None or t >= boundary else 1

    def batch_key(self, state: RequestState) -> Hashable:
        req = state.req
        timesteps = state.timesteps
        if timesteps is None:  # admitted this step: its schedule is a function of its steps
            timesteps = self._timesteps(state.total_steps, req.knobs.get("flow_shift"))
        expert = self._expert(timesteps[min(state.step, len(timesteps) - 1)], req)
        return (req.height, req.width, self.num_frames(req), state.do_cfg, expert)

    # ---- prepare -----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> list[torch.Tensor]:
        embeds = self.pipe._get_t5_prompt_embeds(
            prompts, max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device
        )
        dtype = self.pipe.transformer.dtype
        return [embeds[i : i + 1].to(dtype) for i in range(len(prompts))]

    def prepare(self, states: list[RequestState]) -> None:
        embeds = self._encode([s.req.prompt for s in states])
        cfg_states = [s for s in states if s.do_cfg]
        if cfg_states:
            negs = self._encode([s.req.negative_prompt or "" for s in cfg_states])
            for s, neg in zip(cfg_states, negs, strict=True):
                s.cond["neg"] = neg
        # Noisy latents have the VAE's channels (image-to-video adds condition channels).
        channels = self.pipe.vae.config.z_dim
        for s, emb in zip(states, embeds, strict=True):
            s.cond["embeds"] = emb
            # WanPipeline's draw (WanImageToVideoPipeline's takes the image; its noise is the same).
            s.latents = WanPipeline.prepare_latents(
                self.pipe,
                s.n,
                channels,
                s.req.height,
                s.req.width,
                self.num_frames(s.req),
                torch.float32,
                self.device,
                s.generator,
            )
            self._prepare_image(s)
            sched = self._new_scheduler(s.req.knobs.get("flow_shift"))
            sched.set_timesteps(s.total_steps, device=self.device)
            sched.set_begin_index(0)
            s.cond["scheduler"] = sched
            s.timesteps = sched.timesteps
            s.sigmas = sched.sigmas

    def _prepare_image(self, s: RequestState) -> None:
        """The source image's condition (after the noise is drawn, as in diffusers)."""
        if self.expand_timesteps:
            s.cond["frame_mask"] = (
                wan_image.first_frame_mask(s.latents)
                if s.req.input_images
                else torch.ones(s.latents.shape, dtype=torch.float32, device=self.device)
            )
        if not s.req.input_images:
            return
        s.cond["image"] = wan_image.encode_condition(
            self.pipe,
            s.req.input_images[0],
            s.req.height,
            s.req.width,
            self.num_frames(s.req),
            self.image_mode,
            self.device,
        )

    def _model_input(self, s: RequestState) -> torch.Tensor:
        """A request's transformer input: its latents, with its source image's condition."""
        image = s.cond.get("image")
        if image is None:
            return s.latents
        if self.image_mode == wan_image.CONCAT:
            return torch.cat([s.latents, image.expand(s.n, -1, -1, -1, -1)], dim=1)
        return wan_image.with_first_frame(s.latents, image, s.cond["frame_mask"])

    # ---- denoise -----------------------------------------------------------------------
    def denoise(self, states: list[RequestState]) -> None:
        cfg_states = [s for s in states if s.do_cfg]
        rows = states + cfg_states  # cond rows, then the uncond rows of the CFG requests
        texts = [s.cond["embeds"] for s in states] + [s.cond["neg"] for s in cfg_states]
        expert = self._expert(states[0].timesteps[states[0].step], states[0].req)
        model = self.transformer if expert == 0 else self.transformer_2
        dtype = model.dtype
        inputs = {s: self._model_input(s) for s in states}
        latents = torch.cat([inputs[s] for s in rows]).to(dtype)
        embeds = torch.cat([t.expand(s.n, -1, -1) for s, t in zip(rows, texts, strict=True)])
        ts = [s.timesteps[s.step] for s in rows]
        if self.expand_timesteps:
            # Wan2.2 TI2V: one timestep per latent token (0 on a source image's frame).
            timestep = torch.cat(
                [
                    wan_image.token_timesteps(s.cond["frame_mask"], t, self.patch).expand(s.n, -1)
                    for s, t in zip(rows, ts, strict=True)
                ]
            )
        else:
            timestep = torch.cat([t.expand(s.n) for s, t in zip(rows, ts, strict=True)])
        kwargs = dict(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=embeds,
            attention_kwargs=None,
            return_dict=False,
        )

        def guide(s: RequestState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
            # Wan2.2 guides its low-noise expert with guidance_scale_2 (diffusers' default:
            # guidance_scale).
            scale = s.req.guidance_scale
            if expert == 1:
                scale = s.req.knobs.get("guidance_scale_2", scale)
            return uncond + scale * (cond - uncond)

        # Each expert caches on its own: a switch of expert resets the request's cache.
        noises = self.run_guided(model, states, kwargs, guide, expert=expert)
        for s, noise in zip(states, noises, strict=True):
            t = s.timesteps[s.step]
            s.latents = s.cond["scheduler"].step(noise, t, s.latents, return_dict=False)[0]

    # ---- decode ------------------------------------------------------------------------
    def decode(self, states: list[RequestState]) -> list[list[Image.Image]]:
        """Each state's frames, one VAE call per video.

        A video's decode is the stage's largest working set (at 1280x704 and 121 frames, more
        than its denoising step's), so decoding a group at once multiplies it by the group: two
        such videos decoded together ran out of memory on an 80 GB GPU beside the step's CUDA
        graph pool, where each alone fits.
        """
        vae = self.pipe.vae
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
        frames = []
        for s in states:
            latents = s.latents
            if self.image_mode == wan_image.FIRST_FRAME and "image" in s.cond:
                latents = wan_image.with_first_frame(latents, s.cond["image"], s.cond["frame_mask"])
            latents = latents.to(vae.dtype)
            latents = latents / std.to(latents) + mean.to(latents)
            video = vae.decode(latents, return_dict=False)[0]
            frames.append(
                list(self.pipe.video_processor.postprocess_video(video, output_type="pil")[0])
            )
            for key in ("scheduler", "image", "frame_mask"):
                s.cond.pop(key, None)
        return frames
