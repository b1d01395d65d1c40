"""The MLP up-projection's bias + tanh-GELU computed in the GEMM's epilogue (CUDA; the engine's
default there, DiffusionEngineConfig.fuse_gelu).

Compiled, the FLUX step still spends a separate memory pass per block on the GELU after the
MLP up-projection (inductor leaves the GEMM to cuBLAS and the GELU to a Triton kernel).
`torch._addmm_activation(bias, x, W.T, use_gelu=True)` runs the GEMM through cuBLASLt with its
GELU_BIAS epilogue, so the activation is applied to the accumulator before the one write.

What `_addmm_activation(use_gelu=True)` computes differs by device (torch 2.13): on CUDA,
GELU's tanh approximation (cuBLASLt's epilogue; where cuBLASLt does not take the shapes, a
plain GEMM and then `gelu_(approximate="tanh")`); on CPU, the exact erf GELU. So the fused
module calls it on CUDA only and elsewhere computes `gelu(linear(x), approximate="tanh")`,
and only tanh-GELUs are swapped (an exact-erf GELU is not what the CUDA epilogue computes).
On CUDA the result is the same function, not the same bits: the epilogue applies the GELU to
the float32 accumulator, the unfused path to the output rounded to the model dtype.

Inductor keeps the call as one extern kernel (`make_fallback(aten._addmm_activation)`; its
decomposition into addmm + gelu is not in inductor's table), so the fusion survives compile.
In FLUX's single blocks inductor had fused the GELU into the copy that concatenates the
attention and MLP outputs for proj_out, so a GELU epilogue alone would leave that pass (the
same bytes, without the GELU). There the block's forward is swapped too (`single_block_forward`):
proj_out(cat([attn, mlp])) is computed as attn @ W[:, :d].T + b, then + mlp @ W[:, d:].T
accumulated onto it (cuBLAS's beta = 1), the same sum in two GEMMs over column slices of the
one weight (no copy), and the concatenated tensor is never written. One more rounding of the
partial sum to the model dtype; float32 on CPU: within 1e-6.

Swapped inside the repeated blocks: diffusers' `GELU` modules with `approximate == "tanh"`
(`FeedForward(activation_fn="gelu-approximate")`: FLUX's double-block `ff`/`ff_context`,
Qwen-Image's `img_mlp`/`txt_mlp`, GLM-Image's `ff` and Wan's `ffn` all are), and FLUX's
single-block `proj_mlp` + `act_mlp` (nn.GELU(approximate="tanh")) with that block's forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

# Blocks whose forward is `act_mlp(proj_mlp(x))`, proj_mlp's output used nowhere else.
_PROJ_ACT_BLOCKS = frozenset({"FluxSingleTransformerBlock"})

# (parent, attribute, original); original None: the attribute was added (restore deletes it).
Undo = tuple[nn.Module, str, object | None]


def addmm_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`_addmm_activation(bias, x, weight.T, use_gelu=True)` over the rows of `x` (any leading
    dims). Its GELU is the tanh approximation on CUDA, the exact erf on CPU."""
    lead = x.shape[:-1]
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return out.reshape(*lead, weight.shape[0])


class LinearGeluTanh(nn.Module):
    """gelu(x @ W.T + b, approximate="tanh"): one GEMM with a GELU epilogue on CUDA.

    Holds the Linear's own weight and bias Parameters (no copy) and no nn.Linear, so fp8.py,
    which swaps `type(m) is nn.Linear`, leaves it (and its GEMM) in the model dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return addmm_gelu(x, self.weight, self.bias)
        return F.gelu(F.linear(x, self.weight, self.bias), approximate="tanh")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gelu=tanh"


def single_block_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' FluxSingleTransformerBlock.forward (0.42) with proj_out split at the concat
    boundary (module docstring); its proj_mlp is a LinearGeluTanh. Where proj_out is no longer
    an nn.Linear (fp8 swapped it), the concatenated input goes to it as in diffusers."""
    text_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = block.norm(hidden_states, emb=temb)
    mlp = block.proj_mlp(norm_hidden_states)
    attn = block.attn(
        hidden_states=norm_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    proj_out = block.proj_out
    if type(proj_out) is nn.Linear:
        d, lead = attn.shape[-1], attn.shape[:-1]
        weight = proj_out.weight
        out = F.linear(attn, weight[:, :d], proj_out.bias).reshape(-1, weight.shape[0])
        out = torch.addmm(out, mlp.reshape(-1, mlp.shape[-1]), weight[:, d:].t())
        out = out.reshape(*lead, weight.shape[0])
    else:
        out = proj_out(torch.cat([attn, mlp], dim=2))
    hidden_states = residual + gate.unsqueeze(1) * out
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_len], hidden_states[:, text_len:]


def _fusable(linear: nn.Module) -> bool:
    return type(linear) is nn.Linear and linear.bias is not None


def fuse_block_gelus(blocks: list[nn.Module]) -> list[Undo]:
    """Swap the tanh-GELU MLP up-projections of `blocks` for LinearGeluTanh in place.

    Returns (parent, attribute, original module) per replaced attribute, for `restore`."""
    from diffusers.models.activations import GELU

    undo: list[Undo] = []

    def swap(parent: nn.Module, attr: str, new: nn.Module) -> None:
        undo.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, new)

    for block in blocks:
        for name, module in list(block.named_modules()):
            if type(module) is GELU and module.approximate == "tanh" and _fusable(module.proj):
                parent_name, _, attr = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                swap(parent, attr, LinearGeluTanh(module.proj))
            elif type(module).__name__ in _PROJ_ACT_BLOCKS:
                act = getattr(module, "act_mlp", None)
                proj = getattr(module, "proj_mlp", None)
                if type(act) is nn.GELU and act.approximate == "tanh" and _fusable(proj):
                    swap(module, "proj_mlp", LinearGeluTanh(proj))
                    swap(module, "act_mlp", nn.Identity())
                    if _fusable(getattr(module, "proj_out", None)):
                        undo.append((module, "forward", None))
                        module.forward = types.MethodType(single_block_forward, module)
    return undo


def restore(undo: list[Undo]) -> None:
    """Put back what `fuse_block_gelus` replaced."""
    for parent, attr, original in reversed(undo):
        if original is None:
            delattr(parent, attr)
        else:
            setattr(parent, attr, original)
