"""In-process connector: both stages live in one process, so the payload object itself is handed
over (no copy). Still keyed by descriptor and leased, so the orchestrator code is the same as for
the cross-process connectors."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import torch

from vllm_omni_plugin.common.payload import PAYLOAD_STRUCTS
from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    Deadline,
    PayloadDescriptor,
    StageConnector,
    new_key,
)
from vllm_omni_plugin.connectors.serialization import dtype_name


def _describe(payload: Any) -> tuple[str, str | None, tuple[int, ...], int]:
    if isinstance(payload, torch.Tensor):
        return "tensor", dtype_name(payload.dtype), tuple(payload.shape), payload.nbytes
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return "bytes", None, (len(payload),), len(payload)
    if isinstance(payload, msgspec.Struct) and PAYLOAD_STRUCTS.get(type(payload).__name__):
        return "struct", type(payload).__name__, (), 0  # handed over as is: nothing encoded
    raise ConnectorError(
        f"a {type(payload).__name__} cannot travel between stages: payloads are tensors, "
        "bytes or a struct registered with common.payload.payload_struct"
    )


class InProcConnector(StageConnector):
    kind = "inproc"

    def __init__(self, name: str | None = None, lease_s: float = 300.0):
        super().__init__(name, lease_s)
        self._lock = threading.Lock()
        # key -> (payload, put time (monotonic), lease deadline (monotonic))
        self._items: dict[str, tuple[Any, float, float]] = {}
        self._closed = False

    def put(
        self, request_id: str, from_stage: int, to_stage: int, payload: Any
    ) -> PayloadDescriptor:
        if self._closed:
            raise ConnectorError(f"connector {self.name!r} is closed")
        kind, dtype, shape, nbytes = _describe(payload)
        if isinstance(payload, (bytearray, memoryview)):
            payload = bytes(payload)  # same type contract as the other connectors: bytes out
        key = new_key(request_id, from_stage, to_stage)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            self._items[key] = (payload, now, now + self.lease_s)
        return self._described_put(
            key, request_id, from_stage, to_stage, kind, dtype, shape, nbytes
        )

    def get(self, desc: PayloadDescriptor, timeout: float) -> Any:
        self._check_desc(desc)
        start = time.perf_counter()
        Deadline(timeout)  # validates the argument; nothing here can block
        with self._lock:
            item = self._items.get(desc.key)
        if item is None:
            self.stats.record_failure("consumer")
            raise ConnectorError(
                f"payload {desc.key} is unknown here (released, expired or another process)"
            )
        self.stats.record_transfer("consumer", desc.nbytes, time.perf_counter() - start)
        return item[0]

    def release(self, desc: PayloadDescriptor) -> None:
        with self._lock:
            item = self._items.pop(desc.key, None)
        if item is not None:
            self.stats.record_transfer("producer", desc.nbytes, time.monotonic() - item[1])

    def _expire(self, now: float) -> None:
        for key in [k for k, (_, _, until) in self._items.items() if until <= now]:
            del self._items[key]
            self.stats.record_expired()

    def pending(self) -> int:
        """Payloads put and not yet released (for tests and leak checks)."""
        with self._lock:
            self._expire(time.monotonic())
            return len(self._items)

    def health(self) -> bool:
        return not self._closed

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._items.clear()
