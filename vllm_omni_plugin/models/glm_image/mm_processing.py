"""vLLM's multimodal input path for GLM-Image source images (image-to-image).

vLLM expands each `<|image|>` placeholder of a prompt to one token per vision patch of that image
(t * h * w of its grid: patch 16, no spatial merge, after the image processor's halving) and
hands the model the image's pixel values and grid. The checkpoint's own `GlmImageProcessor`
(loaded from the processor folder the stage passes as tokenizer) provides both; we call its
parts rather than the processor itself because its `__call__` also appends the target-grid
suffix and target grid rows, which belong to the prompt the AR stage builds, not to an image.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
)

from vllm_omni_plugin.families.glm_image.processing import load_processor


class SourceImageProcessor:
    """Callable like an HF processor: text with one `<|image|>` per image -> input_ids with each
    placeholder expanded to its grid's length, pixel_values, image_grid_thw (source grids only).
    The expansion is GlmImageProcessor's own (`replace_image_token`)."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.image_processor = processor.image_processor
        self.tokenizer = processor.tokenizer
        self.image_token = processor.image_token
        self.image_token_id = processor.image_token_id

    def _merge_kwargs(self, kwargs_type=None, **kwargs) -> dict[str, dict]:
        """vLLM 0.26-0.28 process images alone through `call_hf_processor_mm_only`, which asks
        the processor to split its kwargs by modality and then calls `image_processor` itself;
        the image processor needs nothing beyond the checkpoint's own settings."""
        return {k: {} for k in ("text_kwargs", "images_kwargs", "videos_kwargs", "audio_kwargs")}

    def __call__(self, text=None, images=None, return_tensors=None, **kwargs) -> BatchFeature:
        data: dict[str, Any] = {}
        grids = None
        if images:
            out = self.image_processor(images=images, return_tensors="pt")
            data["pixel_values"] = out["pixel_values"]
            data["image_grid_thw"] = grids = out["image_grid_thw"]
        if text is not None:
            texts = [text] if isinstance(text, str) else list(text)
            index = 0
            expanded = []
            for sample in texts:
                # Text alone (vLLM 0.26-0.28 tokenize its dummy "<|image|>" this way at start-up):
                # placeholders stay unexpanded, as GlmImageProcessor leaves them without images.
                parts = sample.split(self.image_token) if grids is not None else [sample]
                pieces = [parts[0]]
                for part in parts[1:]:
                    if grids is None or index >= len(grids):
                        raise ValueError("more image placeholders than images")
                    pieces.append(
                        self.processor.replace_image_token({"image_grid_thw": grids}, index)
                    )
                    pieces.append(part)
                    index += 1
                expanded.append("".join(pieces))
            ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
            data["input_ids"] = [torch.tensor(x) for x in ids] if return_tensors else ids
            if return_tensors and len(ids) == 1:
                data["input_ids"] = torch.tensor(ids)
        return BatchFeature(data)


class GlmImageProcessingInfo(BaseProcessingInfo):
    def get_hf_processor(self, **kwargs: object) -> SourceImageProcessor:
        cfg = self.ctx.model_config
        candidates = [cfg.tokenizer, str(Path(cfg.model).parent / "processor")]
        errors = []
        for path in candidates:
            if not path:
                continue
            try:
                return SourceImageProcessor(load_processor(str(path)))
            except Exception as exc:  # try the next folder
                errors.append(f"{path}: {exc}")
        raise RuntimeError("GLM-Image: no GlmImageProcessor found: " + "; ".join(errors))

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def dummy_image_side(self) -> int:
        # The vision encoder's largest image: the most placeholder tokens one item can need.
        return int(self.get_hf_config().vision_config.image_size)


class GlmImageDummyInputsBuilder(BaseDummyInputsBuilder[GlmImageProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return "<|image|>" * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options=None):
        from PIL import Image

        side = self.info.dummy_image_side()
        image = Image.new("RGB", (side, side), (127, 127, 127))
        return {"image": [image] * mm_counts.get("image", 0)}


class GlmImageMultiModalProcessor(BaseMultiModalProcessor[GlmImageProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        grid = hf_inputs.get("image_grid_thw", torch.empty((0, 3)))
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
            "image_grid_thw": MultiModalFieldConfig.batched("image"),
        }

    def _get_prompt_updates(
        self, mm_items, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs
    ) -> Sequence[PromptReplacement]:
        token = self.info.get_hf_processor().image_token_id

        def replacement(item_idx: int) -> list[int]:
            t, h, w = (int(x) for x in out_mm_kwargs["image"][item_idx]["image_grid_thw"].data)
            return [token] * (t * h * w)

        return [PromptReplacement(modality="image", target=[token], replacement=replacement)]
