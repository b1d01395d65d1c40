"""GLM-Image's DiT stage (diffusers GlmImagePipeline after the AR stage) as batched phases.

Input: the prompt (only its quoted "glyph" text reaches the ByT5 encoder) and the AR stage's
prior token ids ([n or 1, L], as `GlmImagePipeline.generate_prior_tokens` returns them). Math
follows diffusers 0.42 `pipeline_glm_image.py`: glyph embeddings, latents drawn with the
request's generator, integer-spaced timesteps with GLM's sqrt `mu` shift, CFG as a second pass
with the empty glyph prompt and the prior tokens dropped, latents_mean/std before the VAE.

The transformer has no text attention mask, and diffusers left-pads glyph embeddings with zero
vectors that the model does see; to keep each image independent of its batch neighbours, rows
share a forward only when their glyph lengths are equal (one forward per length).

Image-to-image (one source image, `req.input_images`), as diffusers' pipeline with `image`: the
source is fitted as the AR stage fits it (`fit_source_image`), tokenized by the AR checkpoint's
vision tokenizer (loaded here on the first edit: vision encoder + VQ only), its codes upsampled
2x; the VAE-encoded source (mode, normalized) runs once through the transformer at timestep 0
in "write" mode, and the keys/values it leaves condition every conditional step ("read");
unconditional rows skip them. Conditional rows share a forward only with rows whose source
shape is the same; an edit and a text-to-image request still share engine steps and their
unconditional forward.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache
from diffusers.pipelines.glm_image.pipeline_glm_image import (
    calculate_shift,
    retrieve_latents,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from vllm_omni_plugin.families.glm_image.processing import (
    fit_source_image,
    load_vision_tokenizer,
    source_image_codes,
    source_pixel_bounds,
    upsample_codes,
)

from ..errors import RequestValidationError
from ..request import GenerationRequest, RequestState
from .base import DiffusionAdapter, FamilySpec, check_flow_match_scheduler, split_images

MAX_SEQUENCE_LENGTH = 2048


class GlmImageAdapter(DiffusionAdapter):
    pipeline_class = "GlmImagePipeline"
    family = "GLM-Image"
    unsupported = {  # noqa: RUF012 - read only
        "negative_prompt": "GLM-Image takes no negative prompt: its unconditional pass reads "
        "an empty prompt (as diffusers' GlmImagePipeline)",
    }
    # The AR model and its processor run in the AR stage; the DiT stage never loads them.
    skip_components = ("vision_language_encoder", "processor")
    max_input_images = 1

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        check_flow_match_scheduler(pipe.scheduler)
        self.vae_scale_factor = pipe.vae_scale_factor
        self.patch = int(pipe.transformer.config.patch_size)
        self._empty_glyph: torch.Tensor | None = None
        self._vision = None  # (processor, visual, vqmodel), loaded on the first edit

    @property
    def spec(self) -> FamilySpec:
        g = self.vae_scale_factor * self.patch * 2
        size = self.pipe.default_sample_size * self.vae_scale_factor
        return FamilySpec(g, size, size, 50, 1.5, g, 2048)

    def uses_cfg(self, req: GenerationRequest) -> bool:
        return (req.guidance_scale or 0) > 1

    def check_request(self, req: GenerationRequest) -> None:
        ids = req.prior_token_ids
        if ids is None:
            raise RequestValidationError(
                "prior_token_ids", "GLM-Image's DiT needs the AR stage's prior token ids"
            )
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
            raise RequestValidationError("prior_token_ids", "must be a [n, L] LongTensor")
        grid = self.vae_scale_factor * self.patch
        expected = (req.height // grid) * (req.width // grid)
        if ids.shape[0] not in (1, req.n) or ids.shape[1] != expected:
            raise RequestValidationError(
                "prior_token_ids",
                f"shape {tuple(ids.shape)} does not match n={req.n} at {req.height}x{req.width} "
                f"(expected [1 or {req.n}, {expected}])",
            )
        vocab = int(self.pipe.transformer.config.prior_vq_quantizer_codebook_size)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise RequestValidationError("prior_token_ids", f"ids must lie in [0, {vocab})")
        if req.input_images:
            processor = self._vision_tokenizer()[0]
            try:
                fit_source_image(req.input_images[0], *source_pixel_bounds(processor))
            except ValueError as exc:
                raise RequestValidationError("image", str(exc)) from None

    # ---- image-to-image ----------------------------------------------------------------
    def _vision_tokenizer(self):
        if self._vision is None:
            from pathlib import Path

            from transformers import AutoProcessor

            root = Path(self.pipe.name_or_path)
            if not root.is_dir():  # a hub id: the AR stage has fetched the same snapshot
                from huggingface_hub import snapshot_download

                root = Path(
                    snapshot_download(
                        str(self.pipe.name_or_path),
                        allow_patterns=["processor/*", "vision_language_encoder/*"],
                    )
                )
            processor = AutoProcessor.from_pretrained(root / "processor")
            visual, vq = load_vision_tokenizer(
                root / "vision_language_encoder", device=self.device, dtype=self.pipe.dtype
            )
            self._vision = (processor, visual, vq)
        return self._vision

    @torch.no_grad()
    def _condition(self, image: Image.Image) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per transformer layer, the (key, value) of one source image: diffusers' "write" pass."""
        processor, visual, vq = self._vision_tokenizer()
        image = fit_source_image(image, *source_pixel_bounds(processor))
        pix = processor.image_processor(images=[image], return_tensors="pt")
        grid = pix["image_grid_thw"]
        (codes,) = source_image_codes(visual, vq, pix["pixel_values"], grid)
        prior = upsample_codes(codes, int(grid[0, 1]), int(grid[0, 2])).to(self.device)
        width, height = image.size
        pixels = self.pipe.image_processor.preprocess(image, height=height, width=width)
        vae = self.pipe.vae
        dtype = self.pipe.dtype
        latent = retrieve_latents(
            vae.encode(pixels.to(device=self.device, dtype=dtype)), sample_mode="argmax"
        )
        c = vae.config.latent_channels
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1).to(self.device, dtype)
        std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1).to(self.device, dtype)
        latent = (latent - mean) / std
        caches = GlmImageKVCache(num_layers=self.pipe.transformer.config.num_layers)
        caches.set_mode("write")
        empty = torch.zeros(1, 0, self.pipe.transformer.config.text_embed_dim, dtype=dtype)
        self.transformer(
            hidden_states=latent,
            encoder_hidden_states=empty.to(self.device),
            prior_token_id=prior,
            prior_token_drop=torch.zeros_like(prior, dtype=torch.bool),
            timestep=torch.zeros((1,), device=self.device),
            target_size=torch.tensor([[height, width]], device=self.device),
            crop_coords=torch.zeros((1, 2), device=self.device),
            attention_kwargs=None,
            kv_caches=caches,
        )
        return [(layer.k_caches[0], layer.v_caches[0]) for layer in caches.caches]

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        return self.grid_token_geometry(height, width, self.vae_scale_factor * self.patch, 256)

    # ---- prepare -----------------------------------------------------------------------
    def prepares_aside(self, state: RequestState) -> bool:
        """Not an edit: its prepare runs the denoising transformer itself (the source image's
        "write" pass, `_condition`), which the engine thread calls meanwhile, and whose
        wrappers (CUDA graphs, compiled blocks, LoRA row plans, step cache) serve one caller."""
        return not state.req.input_images

    def _glyph_embeds(self, prompts: list[str]) -> list[torch.Tensor]:
        """diffusers' `_get_glyph_embeds`, with all prompts' glyph texts in one encoder call.

        Per prompt, its quoted texts (or [""]) are tokenized, a pad is prepended when the
        number of texts is even (as diffusers does), and the valid tokens of all texts are
        concatenated. Right padding + attention mask keeps each text's valid outputs equal to
        an unbatched call.
        """
        tok = self.pipe.tokenizer
        per_prompt: list[list[list[int]]] = []
        for texts in self.pipe.get_glyph_texts(prompts):
            texts = texts or [""]
            ids = tok(texts, max_length=MAX_SEQUENCE_LENGTH, truncation=True).input_ids
            ids = [[tok.pad_token_id] * ((len(ids) + 1) % 2) + x for x in ids]
            per_prompt.append(ids)
        flat = [x for ids in per_prompt for x in ids]
        longest = max(len(x) for x in flat)
        mask = torch.tensor(
            [[1] * len(x) + [0] * (longest - len(x)) for x in flat], device=self.device
        )
        input_ids = torch.tensor(
            [x + [tok.pad_token_id] * (longest - len(x)) for x in flat], device=self.device
        )
        hidden = self.pipe.text_encoder(input_ids, attention_mask=mask).last_hidden_state
        out, row = [], 0
        for ids in per_prompt:
            k = len(ids)
            valid = hidden[row : row + k][mask[row : row + k].bool()].unsqueeze(0)
            out.append(valid.to(device=self.device, dtype=self.pipe.dtype))
            row += k
        return out

    def prepare(self, states: list[RequestState]) -> None:
        embeds = self._glyph_embeds([s.req.prompt for s in states])
        if any(s.do_cfg for s in states) and self._empty_glyph is None:
            # The unconditional prompt is always "" (diffusers' encode_prompt): encode once.
            self._empty_glyph = self._glyph_embeds([""])[0]
        channels = self.pipe.transformer.config.in_channels
        for s, emb in zip(states, embeds, strict=True):
            s.cond["embeds"] = emb
            if s.do_cfg:
                s.cond["neg"] = self._empty_glyph
            if s.req.input_images:
                s.cond["kv"] = self._condition(s.req.input_images[0])
            ids = s.req.prior_token_ids.to(self.device)
            s.cond["prior"] = (
                ids.repeat_interleave(s.n, dim=0) if ids.shape[0] == 1 and s.n > 1 else ids
            )
            shape = (
                s.n,
                channels,
                s.req.height // self.vae_scale_factor,
                s.req.width // self.vae_scale_factor,
            )
            s.latents = randn_tensor(
                shape, generator=s.generator, device=self.device, dtype=emb.dtype
            )
            self._schedule(s)

    def _schedule(self, s: RequestState) -> None:
        steps = s.total_steps
        sched = self.pipe.scheduler
        seq_len = (s.req.height // self.vae_scale_factor) * (s.req.width // self.vae_scale_factor)
        seq_len //= self.patch**2
        timesteps = np.linspace(sched.config.num_train_timesteps, 1.0, steps + 1)[:-1]
        timesteps = timesteps.astype(np.int64).astype(np.float32)
        sigmas = timesteps / sched.config.num_train_timesteps
        mu = calculate_shift(
            seq_len,
            sched.config.get("base_image_seq_len", 256),
            sched.config.get("base_shift", 0.25),
            sched.config.get("max_shift", 0.75),
        )
        ts, _ = retrieve_timesteps(sched, steps, self.device, timesteps, sigmas, mu=mu)
        self.set_schedule(s, ts)

    # ---- denoise -----------------------------------------------------------------------
    def denoise(self, states: list[RequestState]) -> None:
        # Rows: (state, glyph embeds, drop prior?) for cond, then uncond of CFG requests.
        rows = [(s, s.cond["embeds"], False) for s in states]
        rows += [(s, s.cond["neg"], True) for s in states if s.do_cfg]
        preds: dict[tuple[int, bool], torch.Tensor] = {}
        by_len: dict[tuple, list[tuple[RequestState, torch.Tensor, bool]]] = {}
        cached = any(s.step_cache is not None for s in states)
        for row in rows:
            # Conditional rows of an edit attend to its source keys: same source length only.
            kv = row[0].cond.get("kv") if not row[2] else None
            # With step caching, cond rows run in forwards before the uncond rows: a request's
            # cond rows decide its step for both (CFG rows decide together).
            drop = row[2] and cached
            by_len.setdefault((drop, row[1].shape[1], kv[0][0].shape[1] if kv else 0), []).append(
                row
            )
        groups = [by_len[k] for k in sorted(by_len, key=lambda k: k[0])]
        for group, out in zip(groups, self.forward_groups(self._forward, groups), strict=True):
            for (s, _, drop), chunk in zip(group, out.split([r[0].n for r in group]), strict=True):
                preds[(id(s), drop)] = chunk
        noise = []
        for s in states:
            cond = preds[(id(s), False)]
            if s.do_cfg:
                uncond = preds[(id(s), True)]
                cond = uncond + s.req.guidance_scale * (cond - uncond)
            noise.append(cond)
        self.euler_update(states, torch.cat(noise))

    def _forward(self, rows: list[tuple[RequestState, torch.Tensor, bool]]) -> torch.Tensor:
        tr = self.transformer
        latents = torch.cat([s.latents for s, _, _ in rows])
        embeds = torch.cat([e.expand(s.n, -1, -1) for s, e, _ in rows])
        prior = torch.cat([s.cond["prior"] for s, _, _ in rows])
        drop = torch.cat(
            [torch.full_like(s.cond["prior"], d, dtype=torch.bool) for s, _, d in rows]
        )
        t = torch.cat([s.timesteps[s.step].expand(s.n) for s, _, _ in rows]) - 1
        req0 = rows[0][0].req
        dtype = embeds.dtype
        # On the device from Python numbers without a host copy (torch.tensor(...) would be a
        # blocking upload every step).
        size = torch.stack(
            [torch.full((), v, dtype=dtype, device=self.device) for v in (req0.height, req0.width)]
        ).unsqueeze(0)
        crop = torch.zeros(1, 2, dtype=dtype, device=self.device)
        b = latents.shape[0]
        caches = None
        if rows[0][0].cond.get("kv") is not None and not rows[0][2]:
            # "read": every row's source keys/values, repeated for its n images, before its own.
            caches = GlmImageKVCache(num_layers=len(rows[0][0].cond["kv"]))
            caches.set_mode("read")
            for i, layer in enumerate(caches.caches):
                layer.k_caches = [
                    torch.cat([s.cond["kv"][i][0].expand(s.n, -1, -1, -1) for s, _, _ in rows])
                ]
                layer.v_caches = [
                    torch.cat([s.cond["kv"][i][1].expand(s.n, -1, -1, -1) for s, _, _ in rows])
                ]
        kwargs = dict(
            hidden_states=latents.to(self.pipe.transformer.dtype),
            encoder_hidden_states=embeds,
            prior_token_id=prior,
            prior_token_drop=drop,
            timestep=t,
            target_size=size.repeat(b, 1),
            crop_coords=crop.repeat(b, 1),
            attention_kwargs=None,
            return_dict=False,
            kv_caches=caches,
        )
        tags = [(s, "uncond" if drop else "cond", s.n) for s, _, drop in rows]
        return self.run_transformer(tr, tags, kwargs)[0].float()

    # ---- decode ------------------------------------------------------------------------
    def decode(self, states: list[RequestState]) -> list[list[Image.Image]]:
        vae = self.pipe.vae
        latents = torch.cat([s.latents for s in states]).to(vae.dtype)
        c = vae.config.latent_channels
        mean = (
            torch.tensor(vae.config.latents_mean).view(1, c, 1, 1).to(latents.device, latents.dtype)
        )
        std = (
            torch.tensor(vae.config.latents_std).view(1, c, 1, 1).to(latents.device, latents.dtype)
        )
        latents = latents * std + mean
        image = vae.decode(latents, return_dict=False)[0]
        return split_images(self.postprocess(image), states)
