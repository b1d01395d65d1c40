"""AR-stage fixtures: the tiny GLM-Image folders and transformers' greedy reference tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

PROMPT = "a red cat"


@dataclass(frozen=True)
class GlmTiny:
    root: Path

    @property
    def ar(self) -> str:
        return str(self.root / "vision_language_encoder")

    @property
    def processor(self) -> str:
        return str(self.root / "processor")


@pytest.fixture(scope="session")
def glm_tiny(tiny_models) -> GlmTiny:
    return GlmTiny(tiny_models("glm-image"))


@pytest.fixture(scope="session")
def hf_ar(glm_tiny):
    """transformers' GlmImageForConditionalGeneration and processor on the tiny weights."""
    from transformers import AutoProcessor, GlmImageForConditionalGeneration

    model = GlmImageForConditionalGeneration.from_pretrained(glm_tiny.ar).eval()
    return model, AutoProcessor.from_pretrained(glm_tiny.processor)


@pytest.fixture(scope="session")
def hf_greedy(hf_ar):
    """size -> transformers' greedy tokens for PROMPT at that size (what diffusers feeds
    `generate`: the processor's ids, grids and budget), cached for the session."""
    import torch

    from vllm_omni_plugin.families.glm_image.processing import num_image_tokens

    model, processor = hf_ar
    cache: dict[tuple[int, int], list[int]] = {}

    def get(height: int, width: int) -> list[int]:
        if (height, width) not in cache:
            inputs = processor.apply_chat_template(
                [[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]],
                tokenize=True,
                target_h=height,
                target_w=width,
                return_dict=True,
                return_tensors="pt",
            )
            budget = num_image_tokens(height, width) + 1
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=budget, do_sample=False)
            cache[(height, width)] = out[0, inputs["input_ids"].shape[1] :].tolist()
        return cache[(height, width)]

    return get
