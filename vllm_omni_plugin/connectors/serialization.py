"""Payload <-> flat byte tensor. Tensors travel raw (their own bytes); anything else is pickled.

Pickle is only safe between processes of one deployment that trust each other: stage payloads
come from our own stages, never from clients.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_plugin.connectors.base import ConnectorError, PayloadKind


@dataclass
class Encoded:
    kind: PayloadKind
    dtype: str | None
    shape: tuple[int, ...]
    data: torch.Tensor  # 1-D, contiguous, uint8; may alias the caller's tensor (no copy)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConnectorError(f"unknown tensor dtype {name!r} in payload descriptor")
    return dtype


def bytes_view(buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over `buf` without copying (we never write through it)."""
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch warns that `bytes` is read-only; the view is only ever read.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def encode(payload: Any) -> Encoded:
    if isinstance(payload, torch.Tensor):
        if payload.layout != torch.strided or payload.is_quantized:
            raise ConnectorError(f"cannot send a {payload.layout} / quantized tensor raw")
        flat = payload.detach().contiguous().reshape(-1)
        return Encoded(
            "tensor", dtype_name(payload.dtype), tuple(payload.shape), flat.view(torch.uint8)
        )
    if isinstance(payload, (bytes, bytearray, memoryview)):
        buf = payload.cast("B") if isinstance(payload, memoryview) else payload
        return Encoded("bytes", None, (len(buf),), bytes_view(buf))
    blob = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    return Encoded("object", None, (len(blob),), bytes_view(blob))


def decode(kind: PayloadKind, dtype: str | None, shape: tuple[int, ...], data: torch.Tensor) -> Any:
    """Inverse of `encode`. For tensors the result aliases `data` (the caller owns that buffer)."""
    if kind == "tensor":
        assert dtype is not None
        return data.view(dtype_from_name(dtype)).reshape(shape)
    raw = memoryview(data.cpu().numpy()) if data.numel() else memoryview(b"")
    if kind == "bytes":
        return raw.tobytes()
    if kind == "object":
        return pickle.loads(raw)
    raise ConnectorError(f"unknown payload kind {kind!r}")
