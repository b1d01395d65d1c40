"""A stage process's control connection that carries its connector counters to /metrics.

The stage side of orchestrator/connector_stats.py: each Result a stage sends gets a snapshot of
this process's connector counters under KEY, and so does each EngineMetrics (an AR stage's
timer: a producer's transfers complete after its Result went out), keyed by the sending process
so counters stay monotonic across restarts; the API server side takes them off (`absorb`) and
exports them.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from .messages import EngineMetrics, Result

KEY = "connector_stats"


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
                relayed = {"source": self._source, "snapshots": snaps}
                if isinstance(msg, Result):
                    msg.metrics[KEY] = relayed
                else:
                    msg.connector_stats = relayed
        self._conn.send(msg)

    def __getattr__(self, name: str) -> Any:  # recv, poll, fileno, close: unchanged
        return getattr(self._conn, name)
