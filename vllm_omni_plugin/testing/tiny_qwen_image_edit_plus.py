"""Tiny random-weight Qwen-Image-Edit-2509 checkpoint in the hub layout of
`Qwen/Qwen-Image-Edit-2509` (and, with `zero_cond_t=True`, of `Qwen/Qwen-Image-Edit-2511`).

The components and sizes of the tiny Qwen-Image-Edit checkpoint (tiny_qwen_image_edit.py: the
processor with the real image-processor settings, a Qwen2.5-VL text encoder with the real
vision-patch geometry, the tokenizer whose template prefix is exactly 64 tokens, the MMDiT and
the scheduler; the Qwen-Image VAE at half that checkpoint's width, `build_vae(base_dim=4)`), saved by
`QwenImageEditPlusPipeline.save_pretrained`.
2511's transformer differs only in its config (`zero_cond_t`: the source images' tokens are
modulated at timestep 0).
"""

from __future__ import annotations

from pathlib import Path

from vllm_omni_plugin.testing.tiny_qwen_image import build_scheduler, build_transformer, build_vae
from vllm_omni_plugin.testing.tiny_qwen_image_edit import (
    TEXT_HIDDEN,
    build_text_encoder_vl,
    build_tokenizer,
    save_with_processor,
)


def build(out_dir: Path, seed: int, zero_cond_t: bool = False) -> Path:
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel

    text_encoder = build_text_encoder_vl(seed)
    transformer = build_transformer(seed, TEXT_HIDDEN)
    if zero_cond_t:  # the same weights under 2511's config
        # Bookkeeping keys ("_use_default_values") would reset zero_cond_t to its default.
        config = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
        state = transformer.state_dict()
        transformer = QwenImageTransformer2DModel.from_config({**config, "zero_cond_t": True})
        transformer.load_state_dict(state)
    pipe = QwenImageEditPlusPipeline(
        scheduler=build_scheduler(),
        # Half the tiny Qwen-Image VAE's width: each source image is VAE encoded at diffusers'
        # 1024x1024-pixel area, which at base_dim 8 costs ~5 s per image on one CPU core.
        vae=build_vae(seed, base_dim=4),
        text_encoder=text_encoder,
        tokenizer=build_tokenizer(),
        processor=None,  # written by save_with_processor
        transformer=transformer,
    )
    return save_with_processor(pipe, out_dir)


def build_2511(out_dir: Path, seed: int) -> Path:
    """Qwen-Image-Edit-2511's layout: the 2509 checkpoint with `zero_cond_t` set."""
    return build(out_dir, seed, zero_cond_t=True)
