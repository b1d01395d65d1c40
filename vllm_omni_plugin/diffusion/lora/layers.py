"""Linear layers that add each batch row's own low-rank updates to the base layer's output.

The base weights are never changed (nothing fused, so nothing to undo between requests). Per
forward the store sets a `RowPlan`: for each resident adapter in the batch, the rows that use
it and each row's scale. A wrapped linear computes `y = base(x)` for every row, then per
adapter one pair of matmuls over that adapter's rows only (a grouped matmul: the rows gathered,
or a slice where they are contiguous): `y[rows] += scale_row * scaling * (x[rows] A^T) B^T`,
which is PEFT's `result + lora_B(lora_A(x)) * scaling` with set_adapters' weight in `scaling`.
Rows without an adapter cost nothing beyond the base layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AdapterRows:
    """The rows of one forward that use one adapter, and their scales (x the adapter's own)."""

    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module -> (A, B, scaling)
    index: torch.Tensor | None  # row numbers on the device (None: the rows are `span`)
    scale: torch.Tensor | float  # each row's request scale ([rows] float32), or all rows' one
    span: tuple[int, int] | None  # (lo, hi) when the rows are contiguous


@dataclass
class RowPlan:
    rows: int
    groups: list[AdapterRows]


class LoraLinear(nn.Module):
    """An nn.Linear and the per-row LoRA updates of the current plan (`owner.plan`)."""

    def __init__(self, base: nn.Linear, name: str, owner: Any) -> None:
        super().__init__()
        self.base = base
        self.name = name
        object.__setattr__(self, "_owner", owner)  # not a submodule

    # Code that reads the linear's parameters (dtype checks, fused projections) sees the base's.
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        plan: RowPlan | None = self._owner.plan
        if plan is None:
            return y
        if x.shape[0] != plan.rows:
            raise RuntimeError(
                f"LoRA: {self.name} got {x.shape[0]} rows, the batch plan has {plan.rows}"
            )
        for g in plan.groups:
            w = g.weights.get(self.name)
            if w is None:
                continue
            a, b, scaling = w
            if g.span is not None:
                lo, hi = g.span
                xs = x[lo:hi]
            else:
                xs = x.index_select(0, g.index)
            delta = F.linear(F.linear(xs.to(a.dtype), a), b)
            if isinstance(g.scale, float):
                delta = (delta * (g.scale * scaling)).to(y.dtype)
            else:
                factor = (g.scale * scaling).view(-1, *([1] * (delta.dim() - 1)))
                delta = (delta * factor).to(y.dtype)
            if g.span is not None:
                y[lo:hi] += delta
            else:
                y.index_add_(0, g.index, delta)
        return y


def _declared(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def install(model: nn.Module, prefixes: tuple[str, ...], owner: Any) -> dict[str, tuple[int, int]]:
    """Wrap every nn.Linear of `model` under the declared module prefixes; returns the targets,
    module name (as diffusers' LoRA keys name it) -> (in_features, out_features)."""
    if getattr(getattr(model, "config", None), "zero_cond_t", False):
        # Qwen-Image-Edit-2511 doubles its timestep rows: they are not the batch rows.
        raise TypeError(f"{type(model).__name__} with zero_cond_t does not take LoRA here")
    found = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and _declared(name, prefixes)
    ]
    targets: dict[str, tuple[int, int]] = {}
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(module, name, owner))
        targets[name] = (module.in_features, module.out_features)
    if not targets:
        raise TypeError(f"{type(model).__name__} has no linear under {list(prefixes)}")
    return targets
