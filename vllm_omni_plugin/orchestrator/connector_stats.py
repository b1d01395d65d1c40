"""Connector counters from stage processes to the API server's /metrics.

A connector counts its transfers in the process that uses it: the stage processes, possibly on
another node. Each stage process attaches a snapshot of its counters to every Result it sends (its typed
`connector_stats` field)
(`stages/stats_relay.py` wraps its control connection), and the orchestrator hands them to the connector
package's exporter, keyed by the sending process so counters stay monotonic across restarts.
The snapshot rides the Result itself, so /metrics is current as soon as the request returns.
"""

from __future__ import annotations

import logging

import msgspec

from ..common.messages import ConnectorCounters, Result

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

_exported = False


def absorb(result: Result) -> None:
    """Take the counters off a Result (API server side) and feed them to /metrics."""
    relayed, result.connector_stats = result.connector_stats, None
    absorb_relayed(relayed)


def absorb_relayed(relayed: ConnectorCounters | None) -> None:
    """Feed one relayed snapshot (a Result's or an EngineMetrics') to /metrics."""
    if relayed is None:
        return
    from vllm_omni_plugin.connectors import set_remote_snapshot

    set_remote_snapshot(relayed.source, msgspec.to_builtins(relayed.snapshots))
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
