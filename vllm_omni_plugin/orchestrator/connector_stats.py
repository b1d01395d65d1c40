"""Connector counters from stage processes to the API server's /metrics.

A connector counts its transfers in the process that uses it: the stage processes, possibly on
another node. Each stage process attaches a snapshot of its counters to every Result it sends
(`StatsRelay` wraps its control connection), and the orchestrator hands them to the connector
package's exporter, keyed by the sending process so counters stay monotonic across restarts.
The snapshot rides the Result itself, so /metrics is current as soon as the request returns.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from ..stages.messages import Result

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

KEY = "connector_stats"
_exported = False


class StatsRelay:
    """A stage's control connection that adds connector counters to each Result it sends."""

    def __init__(self, conn: Any):
        self._conn = conn
        self._source = f"{socket.gethostname()}:{os.getpid()}"

    def send(self, msg: Any) -> None:
        if isinstance(msg, Result):
            from vllm_omni_plugin.connectors import ConnectorStats

            snaps = [s.snapshot() for s in ConnectorStats.all()]
            if snaps:
                msg.metrics[KEY] = {"source": self._source, "snapshots": snaps}
        self._conn.send(msg)

    def __getattr__(self, name: str) -> Any:  # recv, poll, fileno, close: unchanged
        return getattr(self._conn, name)


def absorb(result: Result) -> None:
    """Take the counters off a Result (API server side) and feed them to /metrics."""
    relayed = result.metrics.pop(KEY, None) if isinstance(result.metrics, dict) else None
    if not relayed:
        return
    from vllm_omni_plugin.connectors import set_remote_snapshot

    set_remote_snapshot(relayed["source"], relayed["snapshots"])
    ensure_exported()


def ensure_exported() -> None:
    """Register the connector collector on vLLM's Prometheus registry (once per process)."""
    global _exported
    if _exported:
        return
    try:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        from vllm_omni_plugin.connectors import register_prometheus

        register_prometheus(get_prometheus_registry())
        _exported = True
    except Exception as exc:  # metrics are best effort; serving must not fail on them
        logger.warning("connector metrics not exported: %r", exc)
