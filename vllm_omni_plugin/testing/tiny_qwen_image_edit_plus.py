"""Tiny random-weight Qwen-Image-Edit-2509 checkpoint in the hub layout of
`Qwen/Qwen-Image-Edit-2509` (and, with `zero_cond_t=True`, of `Qwen/Qwen-Image-Edit-2511`).

The components and sizes of the tiny Qwen-Image-Edit checkpoint (tiny_qwen_image_edit.py: the
processor with the real image-processor settings, a Qwen2.5-VL text encoder with the real
vision-patch geometry, the tokenizer whose template prefix is exactly 64 tokens, the MMDiT,
the Qwen-Image VAE and the scheduler), saved by `QwenImageEditPlusPipeline.save_pretrained`.
2511's transformer differs only in its config (`zero_cond_t`: the source images' tokens are
modulated at timestep 0).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni_plugin.testing.tiny_qwen_image import (
    build_scheduler,
    build_text_encoder,
    build_transformer,
    build_vae,
)
from vllm_omni_plugin.testing.tiny_qwen_image_edit import (
    SPECIAL_OFFSET,
    TEXT_HIDDEN,
    VOCAB_SIZE,
    build_tokenizer,
    write_processor,
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
