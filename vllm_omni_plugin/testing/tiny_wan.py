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
weight files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Wan2.2 A14B switches from the high-noise to the low-noise expert at t = 0.875 * 1000.
BOUNDARY_RATIO = 0.875


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    from vllm_omni_plugin.testing.tiny_flux import build_t5_tokenizer

    tokenizer = build_t5_tokenizer()
    text_dim = 32
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=text_dim,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
        )
    ).eval()

    def expert(offset: int) -> WanTransformer3DModel:
        torch.manual_seed(seed + offset)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,  # rope splits it 4 (time) + 4 + 4
            in_channels=16,
            out_channels=16,
            text_dim=text_dim,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )

    transformer, transformer_2 = expert(1), expert(2)
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    # With random biases this tiny decoder paints nearly the same video for every latent (its
    # biases dominate features that group norms then rescale); zero biases make the frames
    # follow the latents, so a wrong latent shows up in the pixels.
    with torch.no_grad():
        vae.post_quant_conv.bias.zero_()
        for name, module in vae.decoder.named_modules():
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter) and "norm" not in name:
                bias.zero_()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=3.0,
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=BOUNDARY_RATIO,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    index_file = out_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    # transformers 5 saves T5TokenizerFast as "T5Tokenizer"; the hub's file names the fast one.
    index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir
