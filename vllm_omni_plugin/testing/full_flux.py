"""Random-weight FLUX.1-dev at the published sizes, in the hub layout of
`black-forest-labs/FLUX.1-dev`.

`vllm-omni-plugin make-tiny-model flux DIR --size full` writes the tiny build's folders (see
`tiny_flux`) with every component at the published size and random bf16 weights, built on the
GPU when there is one: 11.9B parameters for the transformer, 4.8B for T5-XXL, 0.12B for CLIP-L.

Where each size comes from (no hub access here; each value is one that code loading the
published checkpoint uses):

- Transformer (`FluxTransformer2DModel`): diffusers 0.42.1's constructor defaults, which are
  FLUX.1-dev's: 19 double-stream and 38 single-stream blocks, 24 heads x 128 (inner 3072),
  joint_attention_dim 4096 (T5-XXL's d_model), pooled_projection_dim 768 (CLIP-L's), in 64
  channels, patch 1, rope axes (16, 56, 56), guidance embedding on (FLUX.1-dev is
  guidance-distilled).
- text_encoder: CLIP ViT-L/14's text tower (`CLIPTextModel`): vocab 49408, hidden 768,
  intermediate 3072, 12 layers, 12 heads, 77 positions, quick_gelu.
- text_encoder_2: T5 v1.1 XXL's encoder (`T5EncoderModel`): vocab 32128, d_model 4096, d_kv 64,
  d_ff 10240, 24 layers, 64 heads, gated-gelu.
- VAE (`AutoencoderKL`): block_out_channels [128, 256, 512, 512], 2 layers per block,
  16 latent channels, 32 groups, scaling 0.3611, shift 0.1159, no quant convs.
- Scheduler and tokenizers: as the tiny build (FLUX.1-dev's scheduler settings; small
  CLIP/T5 vocabularies whose ids all lie inside the real embedding tables).

`num_layers` overrides every stack's depth (both DiT block kinds, CLIP, T5) and keeps every
width: the CPU tests build the full-width model through this same code path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from vllm_omni_plugin.testing.full_build import ComponentWriter, depth, write_model_index
from vllm_omni_plugin.testing.tiny_flux import (
    CLIP_MAX_LENGTH,
    build_clip_tokenizer,
    build_t5_tokenizer,
)

CLIP = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": CLIP_MAX_LENGTH,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
T5 = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "is_encoder_decoder": False,
    "use_cache": False,
}
DIT = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def full_configs(num_layers: int | None = None) -> dict:
    """Every component's config (no weights); `num_layers` overrides each stack's depth."""
    from transformers import CLIPTextConfig, T5Config

    clip_tok = build_clip_tokenizer()
    clip, t5, dit = dict(CLIP), dict(T5), dict(DIT)
    clip["num_hidden_layers"] = depth(clip["num_hidden_layers"], num_layers)
    t5["num_layers"] = depth(t5["num_layers"], num_layers)
    dit["num_layers"] = depth(dit["num_layers"], num_layers)
    dit["num_single_layers"] = depth(dit["num_single_layers"], num_layers)
    clip.update(
        bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id,
        pad_token_id=clip_tok.pad_token_id,
    )
    return {
        "text_encoder": CLIPTextConfig(**clip),
        "text_encoder_2": T5Config(**t5),
        "transformer": dit,
        "vae": dict(VAE),
    }


def build(
    out_dir: Path,
    seed: int,
    num_layers: int | None = None,
    device: str | torch.device | None = None,
    report: Callable[[str], None] = print,
) -> Path:
    """Write the full-size random FLUX.1-dev to `out_dir`; report sizes and timings."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    configs = full_configs(num_layers)
    writer = ComponentWriter(out_dir, seed, device, report)
    writer.write("text_encoder", lambda: CLIPTextModel(configs["text_encoder"]), 0)
    writer.write("text_encoder_2", lambda: T5EncoderModel(configs["text_encoder_2"]), 1)
    writer.write("transformer", lambda: FluxTransformer2DModel(**configs["transformer"]), 2)
    writer.write("vae", lambda: AutoencoderKL(**configs["vae"]), 3)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(Path(out_dir) / "scheduler")
    build_clip_tokenizer().save_pretrained(Path(out_dir) / "tokenizer")
    build_t5_tokenizer().save_pretrained(Path(out_dir) / "tokenizer_2")
    index = {
        "_class_name": "FluxPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    write_model_index(out_dir, index)
    report(writer.summary("FLUX.1-dev", num_layers))
    return Path(out_dir)
