"""How close two tensors are, for the acceleration tests' tolerances."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of `a` against `b`, computed in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())
