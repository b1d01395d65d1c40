"""Tiny random-weight Qwen-Image checkpoint in the hub layout of `Qwen/Qwen-Image`.

Folder (written by `QwenImagePipeline.save_pretrained`, as on the hub)::

    model_index.json
    text_encoder/   transformers Qwen2_5_VLForConditionalGeneration (hidden 32)
    tokenizer/      Qwen2Tokenizer (byte-level BPE)
    transformer/    QwenImageTransformer2DModel (joint_attention_dim = text hidden size)
    vae/            AutoencoderKLQwenImage (z_dim 16, spatial scale 8, as the real one)
    scheduler/      FlowMatchEulerDiscreteScheduler (dynamic shifting, as the real one)

Tokenizer id layout (the real one scaled down; real ids in brackets)::

    0 .. 255     byte-level tokens
    256 .. 399   merges; the pipeline's system prompt prefix tokenizes to exactly 34 tokens,
                 as with the real tokenizer, so `prompt_template_encode_start_idx = 34` drops
                 precisely the template and keeps the user prompt
    400 .. 413   "<|endoftext|>" (151643), "<|im_start|>", "<|im_end|>", object_ref/box/quad
                 markers, "<|vision_start|>" 409 (151652), "<|vision_end|>", "<|vision_pad|>",
                 "<|image_pad|>" 412 (151655), "<|video_pad|>" 413 (151656)
    414 .. 511   unused; vocab_size = 512 (152064)
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_OFFSET = 400
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
VOCAB_SIZE = 512
TEMPLATE_PREFIX_TOKENS = 34  # QwenImagePipeline.prompt_template_encode_start_idx
TEXT_HIDDEN = 32

# Words of QwenImagePipeline's system prompt ("Ġ" = a leading space in byte-level BPE), each
# merged into one token like the real vocabulary does, plus a few common prompt words.
_MERGED_WORDS = (
    "system Describe Ġthe Ġimage Ġby Ġdetailing Ġcolor Ġshape Ġsize Ġtexture Ġquantity Ġtext"
    " Ġspatial Ġrelationships Ġof Ġobjects Ġand Ġbackground user assistant Ġa Ġred Ġcube Ġcat"
).split()


def token_id(name: str, special_offset: int = SPECIAL_OFFSET) -> int:
    return special_offset + SPECIAL_TOKENS.index(name)


def tokenizer_from_words(merged_words, special_offset: int, label: str):
    """Qwen2Tokenizer over byte-level tokens, one merge chain per word of `merged_words` and
    the special tokens from `special_offset` on (the class builds its own pre-tokenizer)."""
    from transformers import Qwen2Tokenizer

    from vllm_omni_plugin.testing.tiny_tokenizers import byte_alphabet, small_merges

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    merges = small_merges(list(merged_words))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    if len(vocab) > special_offset:
        raise AssertionError(f"tiny {label} vocab overflows into special ids: {len(vocab)}")
    vocab.update({name: token_id(name, special_offset) for name in SPECIAL_TOKENS})
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer():
    """Qwen2Tokenizer over the tiny vocabulary above (the class builds its own pre-tokenizer)."""
    return tokenizer_from_words(_MERGED_WORDS, SPECIAL_OFFSET, "Qwen")


def build_text_encoder(
    seed: int,
    *,
    vocab_size: int = VOCAB_SIZE,
    special_offset: int = SPECIAL_OFFSET,
    hidden_size: int = TEXT_HIDDEN,
    max_position_embeddings: int = 4096,
    vision_geometry: dict | None = None,
):
    """Qwen2_5_VLForConditionalGeneration (2 text layers, a 1-block vision tower), seeded with
    `seed`; `vision_geometry` adds vision_config entries (patch/merge sizes)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": vocab_size,
                "hidden_size": hidden_size,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": max_position_embeddings,
                "bos_token_id": token_id("<|endoftext|>", special_offset),
                "eos_token_id": token_id("<|im_end|>", special_offset),
                # sum(mrope_section) = head_dim / 2 (head_dim 16 here; real [16, 24, 24] for 128)
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [2, 3, 3],
                },
            },
            vision_config={
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": hidden_size,
                **(vision_geometry or {}),
                "fullatt_block_indexes": [0],
            },
            image_token_id=token_id("<|image_pad|>", special_offset),
            video_token_id=token_id("<|video_pad|>", special_offset),
            vision_start_token_id=token_id("<|vision_start|>", special_offset),
            vision_end_token_id=token_id("<|vision_end|>", special_offset),
        )
    ).eval()


def build_transformer(seed: int, text_hidden: int = TEXT_HIDDEN):
    """QwenImageTransformer2DModel (2 layers), seeded with `seed + 1`."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed + 1)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels packed 2x2
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_hidden,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim (real: 16, 56, 56)
    )


def build_vae(seed: int, base_dim: int = 8):
    """AutoencoderKLQwenImage (z_dim 16, width `base_dim`), seeded with `seed + 2`; latent stats
    from `seed`."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed + 2)
    gen = torch.Generator().manual_seed(seed)
    return AutoencoderKLQwenImage(
        base_dim=base_dim,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=(torch.randn(16, generator=gen) * 0.5).tolist(),
        latents_std=(1.0 + torch.rand(16, generator=gen) * 2.0).tolist(),
    )


def build_scheduler():
    """FlowMatchEulerDiscreteScheduler with the real checkpoint's dynamic shifting."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import QwenImagePipeline

    text_encoder = build_text_encoder(seed)
    transformer = build_transformer(seed)
    vae = build_vae(seed)
    pipe = QwenImagePipeline(
        scheduler=build_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=build_tokenizer(),
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
