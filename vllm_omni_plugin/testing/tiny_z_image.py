"""Tiny random-weight Z-Image checkpoint in the hub layout of `Tongyi-MAI/Z-Image-Turbo`.

Folder (written by `ZImagePipeline.save_pretrained`, as on the hub)::

    model_index.json
    text_encoder/  transformers Qwen3Model (hidden 32; the pipeline reads hidden_states[-2])
    tokenizer/     Qwen2Tokenizer (byte-level BPE) with a Qwen3-style chat template
    transformer/   ZImageTransformer2DModel (dim 32, 1 main layer, 1 refiner layer each side)
    vae/           AutoencoderKL (16 latent channels, scale 8, FLUX.1's scaling/shift factors)
    scheduler/     FlowMatchEulerDiscreteScheduler (shift 3, no dynamic shifting, as Turbo's)

Tokenizer ids: 0..255 bytes, then merges, then from 400 Qwen's special tokens (tiny_qwen_image's
layout) followed by "<think>" and "</think>" (the chat template writes them when thinking is
off; ZImagePipeline asks for `enable_thinking=True`, which writes neither, as Qwen3's does).
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_omni_plugin.testing.tiny_flux import build_vae
from vllm_omni_plugin.testing.tiny_qwen_image import SPECIAL_OFFSET, tokenizer_from_words

TEXT_HIDDEN = 32
# Qwen3's chat template reduced to what the pipeline sends: one user message and the
# assistant's generation prompt, with the empty think block when thinking is off.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_MERGED_WORDS = "user assistant Ġa Ġred Ġcube Ġcat Ġphoto Ġof Ġthe Ġand Ġwith".split()


def build_tokenizer():
    """Qwen2Tokenizer over the tiny vocabulary, with the chat template above."""
    tok = tokenizer_from_words(_MERGED_WORDS, SPECIAL_OFFSET, "Z-Image")
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_text_encoder(
    seed: int, vocab_size: int, num_layers: int = 2, model_class: str = "Qwen3Model", **config
):
    """transformers `model_class` (Qwen3Model; FLUX.2 klein's Qwen3ForCausalLM) of `num_layers`
    layers, hidden 32, seeded with `seed`; `config`: other Qwen3Config fields."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, model_class)(
        transformers.Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=num_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=1024,
            **config,
        )
    ).eval()


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(seed, vocab_size=512)
    torch.manual_seed(seed + 1)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=TEXT_HIDDEN,
        axes_dims=[4, 6, 6],  # sums to the head dim 16 (real: 32, 48, 48 for 128)
        axes_lens=[1024, 64, 64],
    )
    with torch.no_grad():  # the real pad tokens are trained; zeros would hide a padding bug
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
        ),
        vae=build_vae(seed + 2),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
