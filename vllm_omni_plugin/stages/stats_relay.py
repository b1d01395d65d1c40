"""A stage process's control connection that carries its connector counters to /metrics.

The stage side of orchestrator/connector_stats.py: each Result a stage sends gets a snapshot of
this process's connector counters in its `connector_stats` field, and so does each EngineMetrics (an AR stage's
timer: a producer's transfers complete after its Result went out), keyed by the sending process
so counters stay monotonic across restarts; the API server side takes them off (`absorb`) and
exports them.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import msgspec

from ..common.messages import ConnectorCounters, ConnectorSnapshot, EngineMetrics, Result


class StatsRelay:
    """A stage's control connection that adds connector counters to each Result and
    EngineMetrics it sends."""

    def __init__(self, conn: Any):
        self._conn = conn
        self._source = f"{socket.gethostname()}:{os.getpid()}"

    def send(self, msg: Any) -> None:
        if isinstance(msg, (Result, EngineMetrics)):
            from vllm_omni_plugin.connectors import ConnectorStats

            snaps = [s.snapshot() for s in ConnectorStats.all()]
            if snaps:
                typed = msgspec.convert(snaps, list[ConnectorSnapshot])
                msg.connector_stats = ConnectorCounters(self._source, typed)
        self._conn.send(msg)

    def __getattr__(self, name: str) -> Any:  # recv, poll, fileno, close: unchanged
        return getattr(self._conn, name)
