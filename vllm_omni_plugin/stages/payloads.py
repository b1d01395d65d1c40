"""Stage-to-stage payloads: through the configured connector, or inline when none is set.

A producer puts its output into the edge's connector and sends the small descriptor on the
control path; the consumer gets the payload by descriptor (with a deadline) and releases it.
"""

from __future__ import annotations

from typing import Any

GET_TIMEOUT_S = 30.0


class StagePayloads:
    def __init__(self, connector_specs: dict[str, Any]):
        self._specs = connector_specs
        self._open: dict[str, Any] = {}

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
        return _Via(via, self.connector(via).put(request_id, from_stage, to_stage, payload))

    def receive(self, value: Any) -> Any:
        """The payload behind a value produced by `emit` (released once read)."""
        if not isinstance(value, _Via):
            return value
        conn = self.connector(value.connector)
        try:
            return conn.get(value.desc, timeout=GET_TIMEOUT_S)
        finally:
            conn.release(value.desc)

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
