"""Payload <-> flat byte tensor. Tensors and bytes travel raw (their own bytes); a msgspec
struct registered in common/payload.py travels as its msgpack, decoded against its own type.

Nothing else travels: there is no pickle, and `decode` refuses any other kind (or an unknown
struct name) before it reads a byte, so a forged descriptor cannot make a stage run code.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from vllm_omni_plugin.common.payload import PAYLOAD_STRUCTS, PayloadKind
from vllm_omni_plugin.connectors.base import ConnectorError, check_kind


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
    name = type(payload).__name__
    if isinstance(payload, msgspec.Struct) and PAYLOAD_STRUCTS.get(name) is type(payload):
        blob = msgspec.msgpack.encode(payload)
        return Encoded("struct", name, (len(blob),), bytes_view(blob))
    raise ConnectorError(
        f"a {name} cannot travel between stages: payloads are tensors, bytes or a struct "
        "registered with common.payload.payload_struct"
    )


def decode(kind: PayloadKind, dtype: str | None, shape: tuple[int, ...], data: torch.Tensor) -> Any:
    """Inverse of `encode`. For tensors the result aliases `data` (the caller owns that buffer).
    Any other kind, or a struct name not registered, is refused before `data` is read."""
    check_kind(kind)
    struct_type = PAYLOAD_STRUCTS.get(dtype or "") if kind == "struct" else None
    if kind == "struct" and struct_type is None:
        raise ConnectorError(f"struct payload of unknown type {dtype!r} refused")
    if kind == "tensor":
        assert dtype is not None
        return data.view(dtype_from_name(dtype)).reshape(shape)
    raw = memoryview(data.cpu().numpy()) if data.numel() else memoryview(b"")
    if kind == "bytes":
        return raw.tobytes()
    try:
        return msgspec.msgpack.decode(raw, type=struct_type)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConnectorError(f"struct payload {dtype!r} does not decode: {exc}") from None
