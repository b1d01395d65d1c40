"""Tiny random-weight Qwen-Image-Edit-2509 checkpoint in the hub layout of
`Qwen/Qwen-Image-Edit-2509` (and, with `zero_cond_t=True`, of `Qwen/Qwen-Image-Edit-2511`).

The components and sizes of the tiny Qwen-Image-Edit checkpoint (tiny_qwen_image_edit.py: the
processor with the real image-processor settings, a Qwen2.5-VL text encoder with the real
vision-patch geometry, the tokenizer whose template prefix is exactly 64 tokens, the MMDiT and
the scheduler; the Qwen-Image VAE at half that checkpoint's width, `build_vae`), saved by
`QwenImageEditPlusPipeline.save_pretrained`.
2511's transformer differs only in its config (`zero_cond_t`: the source images' tokens are
modulated at timestep 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_omni_plugin.testing.tiny_qwen_image import (
    build_scheduler,
    build_text_encoder,
    build_transformer,
)
from vllm_omni_plugin.testing.tiny_qwen_image_edit import (
    SPECIAL_OFFSET,
    TEXT_HIDDEN,
    VOCAB_SIZE,
    build_tokenizer,
    write_processor,
)


def build_vae(seed: int):
    """AutoencoderKLQwenImage (z_dim 16, scale 8) of half the tiny Qwen-Image VAE's width: each
    source image is VAE encoded at diffusers' 1024x1024-pixel area, which at base_dim 8 costs
    ~5 s per image on one CPU core, ~2x less here."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed + 2)
    gen = torch.Generator().manual_seed(seed)
    return AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=(torch.randn(16, generator=gen) * 0.5).tolist(),
        latents_std=(1.0 + torch.rand(16, generator=gen) * 2.0).tolist(),
    )


def build(out_dir: Path, seed: int, zero_cond_t: bool = False) -> Path:
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel

    text_encoder = build_text_encoder(
        seed,
        vocab_size=VOCAB_SIZE,
        special_offset=SPECIAL_OFFSET,
        hidden_size=TEXT_HIDDEN,
        max_position_embeddings=8192,
        vision_geometry={"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    )
    transformer = build_transformer(seed, TEXT_HIDDEN)
    if zero_cond_t:  # the same weights under 2511's config
        # Bookkeeping keys ("_use_default_values") would reset zero_cond_t to its default.
        config = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
        state = transformer.state_dict()
        transformer = QwenImageTransformer2DModel.from_config({**config, "zero_cond_t": True})
        transformer.load_state_dict(state)
    pipe = QwenImageEditPlusPipeline(
        scheduler=build_scheduler(),
        vae=build_vae(seed),
        text_encoder=text_encoder,
        tokenizer=build_tokenizer(),
        processor=None,  # written below
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    write_processor(Path(out_dir) / "processor")
    index_file = Path(out_dir) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


def build_2511(out_dir: Path, seed: int) -> Path:
    """Qwen-Image-Edit-2511's layout: the 2509 checkpoint with `zero_cond_t` set."""
    return build(out_dir, seed, zero_cond_t=True)
