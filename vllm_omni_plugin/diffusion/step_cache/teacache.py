"""TeaCache's inputs: the modulated input of the first block, per block class, and the rescaling
polynomials the TeaCache authors fitted per model (github.com/ali-vilab/TeaCache)."""

from __future__ import annotations

from typing import Any

import torch

# TeaCache4FLUX (ali-vilab/TeaCache, TeaCache4FLUX/teacache_flux.py): the polynomial mapping the
# modulated input's relative L1 change to the output's, fitted on FLUX.1-dev. Families without a
# published polynomial use the raw relative change (identity), as TeaCache does before fitting.
RESCALE: dict[str, tuple[float, ...]] = {
    "FluxTransformerBlock": (
        4.98651651e02,
        -2.83781631e02,
        5.58554382e01,
        -3.82021401e00,
        2.64230861e-01,
    ),
}


def rescale(block_class: str, rel_l1: float) -> float:
    coeffs = RESCALE.get(block_class)
    if coeffs is None:
        return rel_l1
    out = 0.0
    for c in coeffs:  # Horner, highest power first (numpy.poly1d's order)
        out = out * rel_l1 + c
    return out


def modulated_input(block: torch.nn.Module, args: dict[str, Any]) -> torch.Tensor:
    """The first block's timestep-modulated image input, the signal TeaCache watches."""
    name = type(block).__name__
    hidden, temb = args["hidden_states"], args.get("temb")
    if name == "FluxTransformerBlock":
        return block.norm1(hidden, emb=temb)[0]
    if name == "QwenImageTransformerBlock":
        mod1 = block.img_mod(temb).chunk(2, dim=-1)[0]
        return block._modulate(block.img_norm1(hidden), mod1)[0]
    if name == "GlmImageTransformerBlock":
        return block.norm1(hidden, args["encoder_hidden_states"], temb)[0]
    if name == "WanTransformerBlock":
        # TeaCache4Wan watches the timestep projection the blocks are modulated with.
        return temb
    raise TypeError(f"teacache has no modulated input for {name}")


def supports(block: torch.nn.Module) -> bool:
    return type(block).__name__ in (
        "FluxTransformerBlock",
        "QwenImageTransformerBlock",
        "GlmImageTransformerBlock",
        "WanTransformerBlock",
    )
