"""Stage-to-stage payloads: through the configured connector, or inline when none is set.

What goes on the control path is typed (common/payload.py): a `Via` (the connector's name and
its descriptor) or, for an edge without a connector, an `InlineTensor`.

A producer puts its output into the edge's connector and sends the small descriptor on the
control path; the consumer gets the payload by descriptor (with a deadline) and releases it.
When the request fails or is cancelled before the consumer got there, the producer releases
what it emitted (`release_request`), so the payload is freed at once, not at lease expiry.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ..common.payload import InlineTensor, StageOutput, Via

GET_TIMEOUT_S = 30.0


class StagePayloads:
    def __init__(self, connector_specs: dict[str, Any]):
        self._specs = connector_specs
        self._open: dict[str, Any] = {}
        # request id -> (lease end, what was emitted for it): kept until the lease ends (the
        # connector forgets the payload by then), so an abort that arrives after the
        # descriptor left this stage can still free it.
        self._emitted: OrderedDict[str, tuple[float, list[Via]]] = OrderedDict()

    def connector(self, name: str):
        if name not in self._open:
            from vllm_omni_plugin.connectors import make_connector

            spec = self._specs[name]
            self._open[name] = make_connector(spec.type, name=spec.name, **dict(spec.options))
        return self._open[name]

    def emit(
        self, payload: Any, request_id: str, from_stage: int, to_stage: int | None, via: str | None
    ) -> StageOutput:
        """What to send on the control path for `payload`: a descriptor, or the inline tensor."""
        if via is None or to_stage is None:
            return inline(payload)
        out = Via(via, self.connector(via).put(request_id, from_stage, to_stage, payload))
        self._remember(request_id, out)
        return out

    def _remember(self, request_id: str, out: Via) -> None:
        now = time.monotonic()
        while self._emitted and next(iter(self._emitted.values()))[0] <= now:
            self._emitted.popitem(last=False)
        until = now + float(getattr(out.desc, "lease_s", 0.0))
        self._emitted.setdefault(request_id, (until, []))[1].append(out)

    def release_request(self, request_id: str) -> int:
        """Release every payload emitted for `request_id` (idempotent); how many there were."""
        _, emitted = self._emitted.pop(request_id, (0.0, []))
        for out in emitted:
            self.release(out)
        return len(emitted)

    def release(self, value: Any) -> None:
        """Release the payload behind a value produced by `emit` (never raises)."""
        if isinstance(value, Via):
            self.connector(value.connector).release(value.desc)

    def receive(self, value: Any) -> Any:
        """The payload behind a value produced by `emit` (released once read)."""
        if isinstance(value, InlineTensor):
            return from_inline(value)
        if not isinstance(value, Via):
            return value
        conn = self.connector(value.connector)
        try:
            return conn.get(value.desc, timeout=GET_TIMEOUT_S)
        finally:
            conn.release(value.desc)

    def receive_all(self, values: list[Any]) -> list[Any]:
        """`receive` for each value, in order; when one fails, all of them are released."""
        try:
            return [self.receive(v) for v in values]
        except BaseException:
            for v in values:
                self.release(v)
            raise

    def close(self) -> None:
        for conn in self._open.values():
            try:
                conn.close()
            except Exception:
                pass
        self._open.clear()


def inline(payload: Any) -> StageOutput:
    """A payload for an edge without a connector: a tensor as InlineTensor (encoded images and
    None are outputs already). TypeError for anything else: configure a connector."""
    import torch

    if payload is None or isinstance(payload, (InlineTensor, Via, bytes)):
        return payload
    if isinstance(payload, (bytearray, memoryview)):
        return bytes(payload)
    if isinstance(payload, list) and all(isinstance(v, (bytes, bytearray)) for v in payload):
        return [bytes(v) for v in payload]
    if isinstance(payload, torch.Tensor):
        t = payload.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        dtype = str(t.dtype).removeprefix("torch.")
        return InlineTensor(dtype, tuple(t.shape), raw.numpy().tobytes())
    raise TypeError(
        f"a {type(payload).__name__} cannot go inline between stages: configure a connector "
        "for this edge"
    )


def from_inline(value: InlineTensor) -> Any:
    """The tensor of an InlineTensor (ValueError for a dtype this torch does not know)."""
    import torch

    dtype = getattr(torch, value.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"inline tensor with unknown dtype {value.dtype!r}")
    if not value.data:
        return torch.empty(value.shape, dtype=dtype)
    return (
        torch.frombuffer(bytearray(value.data), dtype=torch.uint8).view(dtype).reshape(value.shape)
    )
