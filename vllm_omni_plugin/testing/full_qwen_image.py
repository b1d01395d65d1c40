"""Random-weight Qwen-Image at the published sizes, in the hub layout of `Qwen/Qwen-Image`.

`vllm-omni-plugin make-tiny-model qwen-image DIR --size full` writes the tiny build's folders
(see `tiny_qwen_image`) with every component at the published size and random bf16 weights,
built on the GPU when there is one: 20.4B parameters for the MMDiT, 8.3B for the text encoder.

Where each size comes from (no hub access here; each value is one that code loading the
published checkpoint uses):

- Transformer (`QwenImageTransformer2DModel`): diffusers 0.42.1's constructor defaults, which
  are Qwen-Image's: 60 layers, 24 heads x 128 (inner 3072), joint_attention_dim 3584 (the text
  encoder's hidden size), in 64 / out 16 channels, patch 2, rope axes (16, 56, 56), no guidance
  embedding.
- Text encoder: Qwen2.5-VL-7B-Instruct (`Qwen2_5_VLForConditionalGeneration`), the model the
  pipeline's card names: vocab 152064, hidden 3584, intermediate 18944, 28 layers, 28 heads,
  4 KV heads, rope theta 1e6, mrope_section [16, 24, 24], rms eps 1e-6; vision tower depth 32,
  hidden 1280, intermediate 3420, 16 heads, patch 14, merge 2, window 112, full attention in
  blocks 7/15/23/31 (transformers 5.19's Qwen2_5_VL defaults describe the same 7B model).
- VAE (`AutoencoderKLQwenImage`): diffusers' constructor defaults (base_dim 96, z_dim 16,
  dim_mult [1, 2, 4, 4], 2 res blocks, temporal downsampling [False, True, True]) and its
  16-value latents_mean / latents_std, which are the published ones.
- Scheduler and tokenizer: as the tiny build (the real scheduler settings; a byte-level
  tokenizer whose system-prompt prefix is 34 tokens, as the real one's) with the special
  tokens at their real ids (151643 `<|endoftext|>` ... 151656 `<|video_pad|>`).

`num_layers` overrides every stack's depth (text, vision, DiT) and keeps every width: the CPU
tests build the full-width model through this same code path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from vllm_omni_plugin.testing.full_build import ComponentWriter, depth, write_model_index
from vllm_omni_plugin.testing.tiny_qwen_image import (
    _MERGED_WORDS,
    build_scheduler,
    token_id,
    tokenizer_from_words,
)

SPECIAL_OFFSET = 151643  # "<|endoftext|>" in Qwen2's vocabulary

TEXT = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [16, 24, 24],
    },
}
VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_chans": 3,
    "out_hidden_size": 3584,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "hidden_act": "silu",
}
DIT = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}


def full_configs(num_layers: int | None = None) -> dict:
    """Every component's config (no weights); `num_layers` overrides each stack's depth."""
    from transformers import Qwen2_5_VLConfig

    text, vision, dit = dict(TEXT), dict(VISION), dict(DIT)
    text["num_hidden_layers"] = depth(text["num_hidden_layers"], num_layers)
    vision["depth"] = depth(vision["depth"], num_layers)
    vision["fullatt_block_indexes"] = [
        i for i in vision["fullatt_block_indexes"] if i < vision["depth"]
    ] or [0]
    dit["num_layers"] = depth(dit["num_layers"], num_layers)
    text.update(
        bos_token_id=token_id("<|endoftext|>", SPECIAL_OFFSET),
        eos_token_id=token_id("<|im_end|>", SPECIAL_OFFSET),
    )
    encoder = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_id("<|image_pad|>", SPECIAL_OFFSET),
        video_token_id=token_id("<|video_pad|>", SPECIAL_OFFSET),
        vision_start_token_id=token_id("<|vision_start|>", SPECIAL_OFFSET),
        vision_end_token_id=token_id("<|vision_end|>", SPECIAL_OFFSET),
    )
    encoder.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return {"text_encoder": encoder, "transformer": dit}


def build_tokenizer():
    """The tiny byte-level tokenizer with the special tokens at Qwen2's real ids."""
    return tokenizer_from_words(_MERGED_WORDS, SPECIAL_OFFSET, "Qwen (full)")


def build(
    out_dir: Path,
    seed: int,
    num_layers: int | None = None,
    device: str | torch.device | None = None,
    report: Callable[[str], None] = print,
) -> Path:
    """Write the full-size random Qwen-Image to `out_dir`; report sizes and timings."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    configs = full_configs(num_layers)
    writer = ComponentWriter(out_dir, seed, device, report)
    writer.write(
        "text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(configs["text_encoder"]), 0
    )
    writer.write("transformer", lambda: QwenImageTransformer2DModel(**configs["transformer"]), 1)
    writer.write("vae", lambda: AutoencoderKLQwenImage(), 2)
    build_scheduler().save_pretrained(Path(out_dir) / "scheduler")
    build_tokenizer().save_pretrained(Path(out_dir) / "tokenizer")
    index = {
        "_class_name": "QwenImagePipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    write_model_index(out_dir, index)
    report(writer.summary("Qwen-Image", num_layers))
    return Path(out_dir)
