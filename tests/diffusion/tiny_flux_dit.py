"""A tiny FLUX transformer, one step's inputs and its eager output, shared by the speed-option
tests (each module builds its own: the tests swap modules in place and restore them)."""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel

DOUBLE, SINGLE = 2, 2  # double-stream and single-stream blocks


def tiny_flux_step() -> tuple[FluxTransformer2DModel, dict, torch.Tensor]:
    torch.manual_seed(0)
    tr = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=DOUBLE,
        num_single_layers=SINGLE,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    g = torch.Generator().manual_seed(1)
    kw = dict(
        hidden_states=torch.randn(1, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 16, generator=g),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
        txt_ids=torch.zeros(8, 3),
        img_ids=torch.randn(16, 3, generator=g),
        return_dict=False,
    )
    with torch.inference_mode():
        ref = tr(**kw)[0]
    return tr, kw, ref
