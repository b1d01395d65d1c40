"""Qwen-Image-Edit (diffusers QwenImageEditPipeline) as batched phases.

Math follows diffusers 0.42 `pipeline_qwenimage_edit.py`. The one source image is resized to
`condition_pixels` (1024x1024 in diffusers) at its own aspect ratio (multiples of 32); that
resized image goes to the Qwen2.5-VL text encoder inside the templated prompt (its vision tokens
stay in the prompt embeddings; only the 64 template tokens before them are dropped), and, VAE
encoded (the latent mode, no noise drawn) and normalised, is appended after the noisy latents in
the transformer's sequence with its own RoPE frame (`img_shapes` gets a second entry). Only the
noisy latents' part of the prediction is used. Sigmas, true CFG with the norm rescale, the Euler
step and the decode are Qwen-Image's (the parent adapter).

Step batching: requests share a forward when they have the same output size, condition size
and CFG use (`batch_key`); prompts of different lengths (the vision tokens count too) are
right-padded with an `encoder_hidden_states_mask` and attend per row, as in the Qwen-Image
adapter. Text encoding runs once for all newly admitted requests; the VAE encodes each
request's image on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

from ...common.knobs import FAMILY_KNOBS
from ..errors import RequestValidationError
from ..request import GenerationRequest, RequestState
from .qwen_image import MAX_SEQUENCE_LENGTH, QwenImageAdapter


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without a video processor. transformers builds that one only with
    torchvision installed; the edit pipeline never passes videos, so without torchvision the
    same class runs with its image processor and tokenizer (the same __call__ code)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def load_processor(folder: Path) -> Qwen2VLProcessor:
    """The checkpoint's processor/ folder as Qwen2VLProcessor (image-only without torchvision)."""
    try:
        return Qwen2VLProcessor.from_pretrained(folder)
    except ImportError:
        return ImageOnlyQwen2VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(folder),
            tokenizer=AutoTokenizer.from_pretrained(folder),
        )


class QwenImageEditAdapter(QwenImageAdapter):
    pipeline_class = "QwenImageEditPipeline"
    family = "Qwen-Image-Edit"
    knobs = FAMILY_KNOBS["Qwen-Image-Edit"]
    # Loaded by `load_processor` instead (diffusers' loader needs torchvision for it).
    skip_components = ("processor",)
    max_input_images: ClassVar[int] = 1
    requires_input_image: ClassVar[bool] = True
    # diffusers' target area for the condition image (calculate_dimensions(1024 * 1024, ratio)).
    condition_pixels: ClassVar[int] = 1024 * 1024

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        if getattr(pipe, "processor", None) is None:
            pipe.register_modules(processor=load_processor(Path(pipe.name_or_path) / "processor"))

    def check_request(self, req: GenerationRequest) -> None:
        if len(req.input_images) != 1:
            raise RequestValidationError(
                "image", f"Qwen-Image-Edit edits exactly one image, got {len(req.input_images)}"
            )

    def condition_size(self, image) -> tuple[int, int]:
        """(height, width) the source image is resized to, as diffusers computes it."""
        w, h = image.size
        cw, ch, _ = calculate_dimensions(self.condition_pixels, w / h)
        return int(ch), int(cw)

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        tokens, inner, heads = super().token_geometry(height, width)
        # The condition image's latents and its vision tokens in the prompt.
        return tokens + 2 * self.condition_pixels // 256, inner, heads

    def memory_facts(self) -> dict:
        """The tokens token_geometry adds to every row for the most source images belong to
        the source images: each one's share counts per image (Edit-Plus takes several), and
        the VAE encodes each at the VAE's condition size."""
        facts = super().memory_facts()
        fixed = facts["text_tokens"] - MAX_SEQUENCE_LENGTH
        return {
            **facts,
            "text_tokens": MAX_SEQUENCE_LENGTH,
            "source_tokens": fixed // max(1, self.max_input_images),
            "source_pixels": getattr(self, "vae_pixels", self.condition_pixels),
        }

    def batch_key(self, state: RequestState):
        # From the request itself, not from `prepare`'s results: fresh requests are grouped
        # in the same step that prepares them.
        cond_hw = self.condition_size(state.req.input_images[0])
        return (state.req.height, state.req.width, state.do_cfg, cond_hw)

    # ---- prepare -----------------------------------------------------------------------
    def _encode_with_images(self, prompts: list[str], images: list) -> list[torch.Tensor]:
        """One text-encoder call for all (prompt, image) pairs; each row keeps its own tokens."""
        embeds, mask = self.pipe._get_qwen_prompt_embeds(prompts, images, self.device)
        lengths = mask.sum(dim=1).tolist()
        return [embeds[i : i + 1, : int(n)] for i, n in enumerate(lengths)]

    def _encode_prompts(self, states: list[RequestState], images: list) -> list[torch.Tensor]:
        """Each request's prompt embeddings with its `images` entry; for requests running CFG,
        the negative prompt's ("" when none) with the same images, in `s.cond["neg"]`."""
        embeds = self._encode_with_images([s.req.prompt for s in states], images)
        cfg = [(s, im) for s, im in zip(states, images, strict=True) if s.do_cfg]
        if cfg:
            negs = self._encode_with_images(
                [s.req.negative_prompt or "" for s, _ in cfg], [im for _, im in cfg]
            )
            for (s, _), neg in zip(cfg, negs, strict=True):
                s.cond["neg"] = neg
        return embeds

    def _packed_image_latents(
        self, image, height: int, width: int, state: RequestState, dtype: torch.dtype
    ) -> torch.Tensor:
        """`image` at height x width through the VAE, packed as the transformer reads it."""
        pixels = self.pipe.image_processor.preprocess(image, height, width)
        pixels = pixels.unsqueeze(2).to(self.device, dtype)
        # argmax: the latent mode, so the generator is not drawn from (as in diffusers).
        latents = self.pipe._encode_vae_image(pixels, state.generator)
        lh, lw = latents.shape[3:]
        channels = self.pipe.transformer.config.in_channels // 4
        return self.pipe._pack_latents(latents, 1, channels, lh, lw)

    def prepare(self, states: list[RequestState]) -> None:
        proc = self.pipe.image_processor
        prompt_images = []
        for s in states:
            ch, cw = self.condition_size(s.req.input_images[0])
            s.cond["cond_hw"] = (ch, cw)
            prompt_images.append(proc.resize(s.req.input_images[0], ch, cw))
        embeds = self._encode_prompts(states, prompt_images)
        channels = self.pipe.transformer.config.in_channels // 4
        for s, emb, image in zip(states, embeds, prompt_images, strict=True):
            s.cond["embeds"] = emb
            packed = self._packed_image_latents(image, *s.cond["cond_hw"], s, emb.dtype)
            s.cond["image_latents"] = packed.expand(s.n, -1, -1)
            self._init_latents(s, channels, emb.dtype)

    # ---- denoise (the parent's step; these two hooks add the condition image) ----------
    def _hidden_states(self, rows: list[RequestState], latents: torch.Tensor) -> torch.Tensor:
        """Each row's noisy latents followed by its condition image's latents."""
        return torch.cat(
            [torch.cat([s.latents, s.cond["image_latents"]], dim=1) for s in rows], dim=0
        )

    def _img_shapes(self, states: list[RequestState]) -> list[tuple[int, int, int]]:
        """The output frame, then the condition image's own RoPE frame."""
        ch, cw = states[0].cond["cond_hw"]
        g = self.vae_scale_factor * 2
        return [*super()._img_shapes(states), (1, ch // g, cw // g)]
