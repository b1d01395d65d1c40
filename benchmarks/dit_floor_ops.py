"""The matmuls of one DiT forward, as the model itself issues them.

`record_ops` runs a transformer's forward under torch's FakeTensorMode (no memory, no
arithmetic: a full-size model is built and run in about a second on the CPU) and records, in
call order, every `F.linear` (input rows M, in K, out N, bias, which weight) and every
`F.scaled_dot_product_attention` (batch, heads, query and key lengths, head dim, mask). These are
the calls whose time the step cannot avoid; every other op (norms, RoPE, GELU, modulation,
residuals) is what a perfect compiler would fuse away, so it is left out of the floor.

`linear_coverage` checks the list against the module: each Linear of the transformer must have
been called, so the floor cannot silently miss a layer. `analytic_ms` is the roofline time of
an op on a device's datasheet peak (bf16 dense FLOP/s and HBM bytes/s).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ELT = 2  # bytes per bf16 element

# Datasheet peaks (bf16 dense tensor FLOP/s, HBM bytes/s) by device name: SXM parts.
PEAKS = {
    "H200": (989.4e12, 4.8e12),
    "H100": (989.4e12, 3.35e12),
}


@dataclasses.dataclass(frozen=True)
class Op:
    """One GEMM (`linear`: m x k times k x n) or attention call (`sdpa`)."""

    kind: str
    m: int = 0
    k: int = 0
    n: int = 0
    bias: bool = False
    batch: int = 0
    heads: int = 0
    q_len: int = 0
    kv_len: int = 0
    head_dim: int = 0
    mask_shape: tuple[int, ...] = ()  # attention mask's shape; () = no mask

    @property
    def flops(self) -> float:
        if self.kind == "linear":
            return 2.0 * self.m * self.k * self.n
        # QK^T and PV: 2 matmuls of 2 * Lq * Lk * d each, per batch row and head
        return 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim

    @property
    def bytes(self) -> float:
        """What the op must read and write at least once (inputs, weights, output)."""
        if self.kind == "linear":
            return ELT * (self.m * self.k + self.k * self.n + self.m * self.n + self.bias * self.n)
        bh = self.batch * self.heads * self.head_dim
        return ELT * bh * (2 * self.q_len + 2 * self.kv_len)

    def label(self) -> str:
        if self.kind == "linear":
            return f"linear {self.m}x{self.k} @ {self.k}x{self.n}" + (
                " + bias" if self.bias else ""
            )
        mask = f", mask {'x'.join(map(str, self.mask_shape))}" if self.mask_shape else ""
        return (
            f"sdpa b{self.batch} h{self.heads} q{self.q_len} kv{self.kv_len} d{self.head_dim}"
            + mask
        )


def _arg(args, kwargs, i: int, name: str):
    return args[i] if len(args) > i else kwargs.get(name)


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.weights: list[torch.Tensor] = []  # the weight each linear op used, in order

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
            b = _arg(args, kwargs, 2, "bias")
            m = x.numel() // x.shape[-1]
            self.ops.append(Op("linear", m=m, k=w.shape[1], n=w.shape[0], bias=b is not None))
            self.weights.append(w)
        elif func is F.scaled_dot_product_attention:
            q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
            mask = _arg(args, kwargs, 3, "attn_mask")
            batch = q.numel() // (q.shape[-3] * q.shape[-2] * q.shape[-1])
            self.ops.append(
                Op(
                    "sdpa",
                    batch=batch,
                    heads=q.shape[-3],
                    q_len=q.shape[-2],
                    kv_len=k.shape[-2],
                    head_dim=q.shape[-1],
                    mask_shape=() if mask is None else tuple(mask.shape),
                )
            )
        return func(*args, **kwargs)


@dataclasses.dataclass
class Recorded:
    ops: list[Op]
    weights: list[torch.Tensor]


def record_ops(forward) -> Recorded:
    """The linear and attention calls of `forward()` (run it under FakeTensorMode)."""
    rec = _Recorder()
    with torch.inference_mode(), rec:
        forward()
    return Recorded(rec.ops, rec.weights)


def linear_coverage(model: torch.nn.Module, rec: Recorded) -> dict:
    """Which of `model`'s Linear layers the recorded ops used, by weight elements.

    `uncalled` names every Linear whose weight no recorded op used (a layer the floor would
    miss); `weight_elements_used` counts each distinct weight once and equals
    `linear_weight_elements` exactly when nothing is missed."""
    used = {id(w) for w in rec.weights}
    total = used_elts = 0
    uncalled = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            total += mod.weight.numel()
            if id(mod.weight) in used:
                used_elts += mod.weight.numel()
            else:
                uncalled.append(name)
    return {
        "linear_weight_elements": total,
        "weight_elements_used": used_elts,
        "uncalled": uncalled,
        "linear_calls": sum(op.kind == "linear" for op in rec.ops),
    }


def grouped(ops: list[Op]) -> list[tuple[Op, int]]:
    """Distinct ops with their counts, in first-call order."""
    return list(Counter(ops).items())


def analytic_ms(op: Op, peak: tuple[float, float]) -> float:
    """Roofline time of `op`: the larger of its FLOPs at peak compute and its bytes at peak
    bandwidth."""
    flops_per_s, bytes_per_s = peak
    return 1e3 * max(op.flops / flops_per_s, op.bytes / bytes_per_s)


def peak_for(device_name: str) -> tuple[str, tuple[float, float]] | None:
    for key, peak in PEAKS.items():
        if key in device_name:
            return key, peak
    return None
