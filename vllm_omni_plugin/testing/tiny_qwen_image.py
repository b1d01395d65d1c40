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

# Words of QwenImagePipeline's system prompt ("Ġ" = a leading space in byte-level BPE), each
# merged into one token like the real vocabulary does, plus a few common prompt words.
_MERGED_WORDS = (
    "system Describe Ġthe Ġimage Ġby Ġdetailing Ġcolor Ġshape Ġsize Ġtexture Ġquantity Ġtext"
    " Ġspatial Ġrelationships Ġof Ġobjects Ġand Ġbackground user assistant Ġa Ġred Ġcube Ġcat"
).split()


def _token_id(name: str) -> int:
    return SPECIAL_OFFSET + SPECIAL_TOKENS.index(name)


def build_tokenizer():
    """Qwen2Tokenizer over the tiny vocabulary above (the class builds its own pre-tokenizer)."""
    from transformers import Qwen2Tokenizer

    from vllm_omni_plugin.testing.tiny_tokenizers import byte_alphabet, small_merges

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    merges = small_merges(_MERGED_WORDS)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    if len(vocab) > SPECIAL_OFFSET:
        raise AssertionError(f"tiny Qwen vocab overflows into special ids: {len(vocab)}")
    vocab.update({name: _token_id(name) for name in SPECIAL_TOKENS})
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_hidden = 32
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": text_hidden,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": 4096,
                "bos_token_id": _token_id("<|endoftext|>"),
                "eos_token_id": _token_id("<|im_end|>"),
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
                "out_hidden_size": text_hidden,
                "fullatt_block_indexes": [0],
            },
            image_token_id=_token_id("<|image_pad|>"),
            video_token_id=_token_id("<|video_pad|>"),
            vision_start_token_id=_token_id("<|vision_start|>"),
            vision_end_token_id=_token_id("<|vision_end|>"),
        )
    ).eval()

    torch.manual_seed(seed + 1)
    transformer = QwenImageTransformer2DModel(
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

    torch.manual_seed(seed + 2)
    gen = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=(torch.randn(16, generator=gen) * 0.5).tolist(),
        latents_std=(1.0 + torch.rand(16, generator=gen) * 2.0).tolist(),
    )

    scheduler = FlowMatchEulerDiscreteScheduler(
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

    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=build_tokenizer(),
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
