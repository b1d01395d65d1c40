"""Opt-in fp8 GEMMs for the denoising transformer's block linears (lossy: off by default).

Each `nn.Linear` inside the repeated blocks becomes an `Fp8Linear`: the weight is quantized once
to float8 e4m3 with one scale per output channel; the activation is quantized per call with one
scale per row (dynamic per-row scaling), and `torch._scaled_mm` multiplies the two in fp8 with
float32 accumulation, applying both scales in its epilogue. Per-row scales keep an
outlier token or channel from flattening the precision of all the others (a per-tensor scale
would). The adaLN modulation linears (one row per image) and everything outside the blocks
(embedders, final projection) stay in the model dtype: they cost nothing and the output
projection is the most sensitive.

fp8 tensor-core matmuls need compute capability 8.9 or newer (Ada, Hopper); `fp8_supported`
says why a device cannot, and the engine refuses the knob there instead of falling back.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# torch._scaled_mm wants both matrix dims multiples of 16.
_ALIGN = 16
# Linears whose input has one row per image (adaLN modulation): never worth quantizing.
_SKIP_NAME_PARTS = ("norm",)


def fp8_supported(device: torch.device) -> str | None:
    """None when `device` runs fp8 GEMMs, else the reason it cannot."""
    if device.type != "cuda":
        return f"fp8 GEMMs need a CUDA GPU of compute capability >= 8.9; the stage runs on {device}"
    if not torch.cuda.is_available():
        return "fp8 GEMMs need CUDA, which this torch build cannot use"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(index)
        return f"fp8 GEMMs need compute capability >= 8.9; {name} has {major}.{minor}"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scale per row) of a 2-D tensor: x ~= values * scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Linear(nn.Module):
    """A Linear computed as fp8 x fp8 -> model dtype with per-row and per-channel scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        w, w_scale = quantize_rows(linear.weight.detach())
        # [out, in] row-major: its transpose is the column-major operand _scaled_mm wants.
        self.register_buffer("weight_fp8", w)
        self.register_buffer("weight_scale", w_scale.t().contiguous())  # [1, out]
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        q, scale = quantize_rows(x2)
        out = torch._scaled_mm(
            q,
            self.weight_fp8.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            out_dtype=self.out_dtype,
        )
        # The bias is added here, not in _scaled_mm's epilogue, which refuses it for some scale
        # layouts; torch.compile fuses the add into the next elementwise kernel anyway.
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"


def quantizable(name: str, module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.in_features % _ALIGN == 0
        and module.out_features % _ALIGN == 0
        and not any(part in name for part in _SKIP_NAME_PARTS)
    )


def quantize_block_linears(blocks: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Swap the quantizable linears of `blocks` for Fp8Linear in place.

    Returns (parent, attribute, original linear) for each swap, so `restore_linears` can undo it.
    """
    swapped = []
    for block in blocks:
        for name, module in list(block.named_modules()):
            if not quantizable(name, module):
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, Fp8Linear(module))
            swapped.append((parent, attr, module))
    return swapped


def restore_linears(swapped: list[tuple[nn.Module, str, nn.Linear]]) -> None:
    for parent, attr, linear in swapped:
        setattr(parent, attr, linear)
