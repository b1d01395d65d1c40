"""A tiny GLM-Image DiT and one CFG forward's inputs, shared by the speed-option tests (and the
fresh processes tests/diffusion/test_compile_cache.py starts)."""

from __future__ import annotations

import torch
from diffusers import GlmImageTransformer2DModel


def tiny_glm_dit() -> GlmImageTransformer2DModel:
    torch.manual_seed(0)
    return GlmImageTransformer2DModel(
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=32,
        time_embed_dim=32,
        condition_dim=16,
        prior_vq_quantizer_codebook_size=64,
    ).eval()


def glm_inputs(text_len: int, seed: int = 1) -> dict:
    """A CFG pair as the adapter sends it: row 0 conditional, row 1 with its prior dropped."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(2, 16, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(2, text_len, 32, generator=g),
        prior_token_id=torch.randint(0, 64, (2, 16), generator=g),
        prior_token_drop=torch.tensor([[False] * 16, [True] * 16]),
        timestep=torch.tensor([500.0, 500.0]),
        target_size=torch.tensor([[64.0, 64.0]] * 2),
        crop_coords=torch.zeros(2, 2),
        return_dict=False,
    )


def reference(tr, kw) -> torch.Tensor:
    # diffusers' forward writes into its drop mask's selection only; pass a copy anyway
    return tr(**{**kw, "prior_token_drop": kw["prior_token_drop"].clone()})[0]
