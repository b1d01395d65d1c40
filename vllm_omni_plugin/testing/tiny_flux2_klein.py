"""Tiny random-weight FLUX.2 klein checkpoint in the hub layout of `black-forest-labs/FLUX.2-klein-*`.

Folder (written by `Flux2KleinPipeline.save_pretrained`, as on the hub)::

    model_index.json  is_distilled false (as the klein "base" checkpoints: CFG with the empty
                      prompt; the step-distilled klein checkpoints say true and run without it)
    text_encoder/     transformers Qwen3ForCausalLM (hidden 32, 27 layers: the pipeline stacks
                      hidden states 9, 18 and 27, so the text width is 3 x 32 = 96)
    tokenizer/        Qwen2Tokenizer (byte-level BPE) with a Qwen3-style chat template
    transformer/      Flux2Transformer2DModel (1 double + 1 single block, no guidance embedding)
    vae/              AutoencoderKLFlux2 (32 latent channels patchified 2x2 to 128, scale 8,
                      random batch-norm statistics so the latent un-normalisation is exercised)
    scheduler/        FlowMatchEulerDiscreteScheduler (dynamic shifting, as the real one)

Tokenizer ids as in tiny_z_image (Qwen's layout, "<think>"/"</think>" added: the pipeline asks
for `enable_thinking=False`, which writes the empty think block).
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_omni_plugin.testing.tiny_flux import build_scheduler
from vllm_omni_plugin.testing.tiny_z_image import TEXT_HIDDEN, build_text_encoder, build_tokenizer

TEXT_LAYERS = 27  # Flux2KleinPipeline reads hidden_states[9], [18] and [27]


def build_vae(seed: int):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=32,
        norm_num_groups=4,
        sample_size=64,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=gen) * 0.5)
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=gen))
    return vae


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(
        seed, 512, TEXT_LAYERS, "Qwen3ForCausalLM", tie_word_embeddings=True
    )
    torch.manual_seed(seed + 1)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,  # 32 latent channels patchified 2x2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_HIDDEN,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim (real: 32 x 4 for 128)
        guidance_embeds=False,
    )
    pipe = Flux2KleinPipeline(
        scheduler=build_scheduler(),
        vae=build_vae(seed + 2),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
