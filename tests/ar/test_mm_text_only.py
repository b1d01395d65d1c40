"""The GLM-Image source-image processor called with text alone (vLLM 0.26-0.28 do this at start-up
with their dummy "<|image|>" text; an error there kept the AR stage from starting on the H200)."""

from __future__ import annotations

from PIL import Image

from vllm_omni_plugin.families.glm_image.processing import load_processor
from vllm_omni_plugin.models.glm_image.mm_processing import SourceImageProcessor


def test_text_alone_keeps_the_placeholder_and_an_image_expands_it(glm_tiny):
    proc = SourceImageProcessor(load_processor(glm_tiny.processor))
    text = "a cat <|image|> on a mat"
    alone = proc(text=text, return_tensors="pt")["input_ids"][0].tolist()
    assert alone == proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert alone.count(proc.image_token_id) == 1
    with_image = proc(text=text, images=[Image.new("RGB", (64, 64))], return_tensors="pt")
    assert with_image["input_ids"][0].tolist().count(proc.image_token_id) > 1
