"""Stage-to-stage payloads: through the configured connector, or inline when none is set.

A producer puts its output into the edge's connector and sends the small descriptor on the
control path; the consumer gets the payload by descriptor (with a deadline) and releases it.
When the request fails or is cancelled before the consumer got there, the producer releases
what it emitted (`release_request`), so the payload is freed at once, not at lease expiry.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

GET_TIMEOUT_S = 30.0


class StagePayloads:
    def __init__(self, connector_specs: dict[str, Any]):
        self._specs = connector_specs
        self._open: dict[str, Any] = {}
        # request id -> (lease end, what was emitted for it): kept until the lease ends (the
        # connector forgets the payload by then), so an abort that arrives after the
        # descriptor left this stage can still free it.
        self._emitted: OrderedDict[str, tuple[float, list[_Via]]] = OrderedDict()

    def connector(self, name: str):
        if name not in self._open:
            from vllm_omni_plugin.connectors import make_connector

            spec = self._specs[name]
            self._open[name] = make_connector(spec.type, name=spec.name, **dict(spec.options))
        return self._open[name]

    def emit(
        self, payload: Any, request_id: str, from_stage: int, to_stage: int | None, via: str | None
    ) -> Any:
        """What to send on the control path for `payload`: a descriptor, or the payload."""
        if via is None or to_stage is None:
            return payload
        out = _Via(via, self.connector(via).put(request_id, from_stage, to_stage, payload))
        self._remember(request_id, out)
        return out

    def emit_chunk(
        self, payload: Any, request_id: str, from_stage: int, to_stage: int | None, via: str | None
    ) -> Any:
        """`emit` for one chunk of a streamed output: not remembered here, the stream keeps
        each chunk until its consumer is done with it (stages/streams.py)."""
        if via is None or to_stage is None:
            return payload
        return _Via(via, self.connector(via).put(request_id, from_stage, to_stage, payload))

    def _remember(self, request_id: str, out: _Via) -> None:
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
        if isinstance(value, _Via):
            self.connector(value.connector).release(value.desc)

    def receive(self, value: Any) -> Any:
        """The payload behind a value produced by `emit` (released once read)."""
        if not isinstance(value, _Via):
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


class _Via:
    """A connector descriptor tagged with the connector's name (picklable)."""

    __slots__ = ("connector", "desc")

    def __init__(self, connector: str, desc: Any):
        self.connector = connector
        self.desc = desc

    def __getstate__(self):
        return (self.connector, self.desc)

    def __setstate__(self, state):
        self.connector, self.desc = state
