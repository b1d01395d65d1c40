"""Tiny random-weight Wan2.2 text-to-video checkpoint in the hub layout of
`Wan-AI/Wan2.2-T2V-A14B-Diffusers`.

Folder (written by `WanPipeline.save_pretrained`, as on the hub)::

    model_index.json   WanPipeline, boundary_ratio 0.875 (Wan2.2's two-expert switch)
    text_encoder/      UMT5EncoderModel (d_model 32)
    tokenizer/         T5TokenizerFast (the tiny unigram vocabulary FLUX's builder uses)
    transformer/       WanTransformer3DModel, the high-noise expert (patch 1x2x2, 2 layers)
    transformer_2/     WanTransformer3DModel, the low-noise expert (same shape, other weights)
    vae/               AutoencoderKLWan (z_dim 16, spatial scale 8, temporal scale 4)
    scheduler/         UniPCMultistepScheduler, flow prediction with Wan2.2's flow_shift

A 32x32, 9-frame video takes well under a second per step on a CPU. Same seed -> identical
weight files. The image-to-video builders (tiny_wan_i2v.py, tiny_wan_ti2v.py) share the parts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Wan2.2 A14B switches from the high-noise to the low-noise expert at t = 0.875 * 1000.
BOUNDARY_RATIO = 0.875
TEXT_DIM = 32


def text_parts(seed: int) -> tuple[Any, Any]:
    """(tokenizer, UMT5 text encoder) of every tiny Wan checkpoint."""
    from vllm_omni_plugin.testing.tiny_flux import build_t5_encoder, build_t5_tokenizer

    tokenizer = build_t5_tokenizer()
    return tokenizer, build_t5_encoder(seed, len(tokenizer), umt5=True)


def expert(seed: int, in_channels: int = 16, out_channels: int = 16):
    """One tiny WanTransformer3DModel (patch 1x2x2, 2 layers)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # rope splits it 4 (time) + 4 + 4
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def zero_decoder_biases(vae) -> None:
    """With random biases this tiny decoder paints nearly the same video for every latent (its
    biases dominate features that group norms then rescale); zero biases make the frames
    follow the latents, so a wrong latent shows up in the pixels."""
    with torch.no_grad():
        vae.post_quant_conv.bias.zero_()
        for name, module in vae.decoder.named_modules():
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter) and "norm" not in name:
                bias.zero_()


def scheduler(flow_shift: float):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=flow_shift,
    )


def save(pipe, out_dir: Path) -> Path:
    pipe.save_pretrained(out_dir, safe_serialization=True)
    index_file = out_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    # transformers 5 saves T5TokenizerFast as "T5Tokenizer"; the hub's file names the fast one.
    index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


def wan21_vae(seed: int):
    """The Wan2.1 VAE's shape (Wan2.2 A14B uses it): z_dim 16, spatial 8, temporal 4."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    zero_decoder_biases(vae)
    return vae


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import WanPipeline

    tokenizer, text_encoder = text_parts(seed)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=wan21_vae(seed + 3),
        scheduler=scheduler(3.0),
        transformer=expert(seed + 1),
        transformer_2=expert(seed + 2),
        boundary_ratio=BOUNDARY_RATIO,
    )
    return save(pipe, out_dir)
