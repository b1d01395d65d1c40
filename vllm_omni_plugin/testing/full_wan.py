"""Random-weight Wan2.2 at the published sizes: TI2V-5B in the hub layout of
`Wan-AI/Wan2.2-TI2V-5B-Diffusers`, and T2V-A14B (two experts) in that of
`Wan-AI/Wan2.2-T2V-A14B-Diffusers`.

`vllm-omni-plugin make-tiny-model wan-ti2v DIR --size full` writes the tiny TI2V build's folders
(see `tiny_wan_ti2v`) with every component at the published size and random bf16 weights, built
on the GPU when there is one: 5.00B parameters for the transformer, 5.68B for the UMT5-XXL
encoder, 0.70B for the Wan2.2 VAE. `make-tiny-model wan DIR --size full` writes T2V-A14B the
same way (see `tiny_wan`): two 14.29B experts, the same encoder, the Wan2.1 VAE (0.13B).

Where each size comes from (no hub access here; each value is one that code loading the
published checkpoint uses):

- Transformer (`WanTransformer3DModel`): the configs diffusers' own conversion script
  (`scripts/convert_wan_to_diffusers.py`, model types "Wan2.2-TI2V-5B" and "Wan2.2-T2V-A14B")
  writes for the published checkpoints. TI2V-5B: 30 layers, 24 heads x 128 (inner 3072), FFN
  14336, 48 channels in and out, patch (1, 2, 2), text_dim 4096 (UMT5-XXL's d_model), freq_dim
  256, cross-attention norm, RMS q/k norm across heads, eps 1e-6; Wan's own config for the model
  (`wan/configs/wan_ti2v_5B.py`: dim 3072, ffn_dim 14336, 24 heads, 30 layers, in_dim 48) says
  the same. T2V-A14B: each expert is diffusers 0.42.1's constructor defaults (40 layers, 40
  heads x 128, FFN 13824, 16 channels), which the conversion script's config repeats.
- text_encoder: UMT5-XXL's encoder (`UMT5EncoderModel`, the `google/umt5-xxl` config the Wan
  Diffusers checkpoints ship): vocab 256384, d_model 4096, d_kv 64, d_ff 10240, 24 layers,
  64 heads, gated-gelu, 32 relative-attention buckets (max distance 128), eps 1e-6.
- VAE (`AutoencoderKLWan`): TI2V-5B's is the Wan2.2 VAE, the conversion script's
  `vae22_diffusers_config`: base_dim 160, decoder_base_dim 256, z_dim 48, residual blocks,
  12 channels in and out (pixels patched 2x2), spatial scale 16, temporal scale 4, and its
  48-value latents_mean / latents_std (the script's `clip_output: False` is not a parameter of
  diffusers 0.42.1's class and is left out). T2V-A14B's is the Wan2.1 VAE: diffusers'
  constructor defaults (base_dim 96, z_dim 16, spatial 8, temporal 4), which the conversion
  script builds for it.
- Scheduler: `UniPCMultistepScheduler`, flow prediction with flow sigmas, 1000 train steps,
  flow_shift 5.0 for TI2V-5B and 3.0 for T2V-A14B (the conversion script's values).
  Pipeline flags: TI2V-5B `expand_timesteps` (one timestep per latent token), T2V-A14B
  `boundary_ratio` 0.875 (the script's; the high-noise expert above t = 875).
- Tokenizer: the tiny build's (a small unigram vocabulary whose ids, pad 0 and eos 1 as in
  UMT5's, all lie inside the real embedding table).

`num_layers` overrides every stack's depth (UMT5 and each transformer) and keeps every width;
the VAE is built whole. The CPU tests build the full-width model through this same code path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from vllm_omni_plugin.testing.full_build import ComponentWriter, depth, write_model_index
from vllm_omni_plugin.testing.tiny_flux import build_t5_tokenizer
from vllm_omni_plugin.testing.tiny_wan import BOUNDARY_RATIO, scheduler

UMT5 = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "tie_word_embeddings": False,
    "is_encoder_decoder": False,
    "use_cache": False,
}
A14B_DIT = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
}
TI2V_DIT = {
    **A14B_DIT,
    "num_attention_heads": 24,
    "in_channels": 48,
    "out_channels": 48,
    "ffn_dim": 14336,
    "num_layers": 30,
}
# fmt: off
VAE22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
VAE22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]
# fmt: on
VAE22 = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    "latents_mean": VAE22_LATENTS_MEAN,
    "latents_std": VAE22_LATENTS_STD,
}
VAE21: dict = {}  # diffusers' AutoencoderKLWan defaults are the Wan2.1 VAE
TI2V_FLOW_SHIFT = 5.0
A14B_FLOW_SHIFT = 3.0


def full_configs(num_layers: int | None = None, variant: str = "ti2v-5b") -> dict:
    """Every component's config (no weights) of `variant` ("ti2v-5b" or "t2v-a14b");
    `num_layers` overrides each stack's depth."""
    from transformers import UMT5Config

    if variant not in ("ti2v-5b", "t2v-a14b"):
        raise ValueError(f"unknown Wan2.2 variant {variant!r}")
    umt5, dit = dict(UMT5), dict(TI2V_DIT if variant == "ti2v-5b" else A14B_DIT)
    umt5["num_layers"] = depth(umt5["num_layers"], num_layers)
    dit["num_layers"] = depth(dit["num_layers"], num_layers)
    return {
        "text_encoder": UMT5Config(**umt5),
        "transformer": dit,
        "vae": dict(VAE22 if variant == "ti2v-5b" else VAE21),
    }


def _index(**extra) -> dict:
    import diffusers

    return {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        **extra,
    }


def _write_text_parts(writer: ComponentWriter, configs: dict, out_dir: Path) -> None:
    from transformers import UMT5EncoderModel

    writer.write("text_encoder", lambda: UMT5EncoderModel(configs["text_encoder"]), 0)
    build_t5_tokenizer().save_pretrained(Path(out_dir) / "tokenizer")


def build(
    out_dir: Path,
    seed: int,
    num_layers: int | None = None,
    device: str | torch.device | None = None,
    report: Callable[[str], None] = print,
) -> Path:
    """Write the full-size random Wan2.2 TI2V-5B to `out_dir`; report sizes and timings."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    configs = full_configs(num_layers, "ti2v-5b")
    writer = ComponentWriter(out_dir, seed, device, report)
    _write_text_parts(writer, configs, out_dir)
    writer.write("transformer", lambda: WanTransformer3DModel(**configs["transformer"]), 1)
    writer.write("vae", lambda: AutoencoderKLWan(**configs["vae"]), 2)
    scheduler(TI2V_FLOW_SHIFT).save_pretrained(Path(out_dir) / "scheduler")
    index = _index(boundary_ratio=None, expand_timesteps=True, transformer_2=[None, None])
    write_model_index(out_dir, index)
    report(writer.summary("Wan2.2 TI2V-5B", num_layers))
    return Path(out_dir)


def build_t2v_a14b(
    out_dir: Path,
    seed: int,
    num_layers: int | None = None,
    device: str | torch.device | None = None,
    report: Callable[[str], None] = print,
) -> Path:
    """Write the full-size random Wan2.2 T2V-A14B (both experts) to `out_dir`."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    configs = full_configs(num_layers, "t2v-a14b")
    writer = ComponentWriter(out_dir, seed, device, report)
    _write_text_parts(writer, configs, out_dir)
    writer.write("transformer", lambda: WanTransformer3DModel(**configs["transformer"]), 1)
    writer.write("transformer_2", lambda: WanTransformer3DModel(**configs["transformer"]), 2)
    writer.write("vae", lambda: AutoencoderKLWan(**configs["vae"]), 3)
    scheduler(A14B_FLOW_SHIFT).save_pretrained(Path(out_dir) / "scheduler")
    index = _index(
        boundary_ratio=BOUNDARY_RATIO,
        expand_timesteps=False,
        transformer_2=["diffusers", "WanTransformer3DModel"],
    )
    write_model_index(out_dir, index)
    report(writer.summary("Wan2.2 T2V-A14B", num_layers))
    return Path(out_dir)
