"""Stage-to-stage payload transport: in-process, shared memory (one node), NIXL (across nodes).

    conn = make_connector("nixl", name="nixl")
    desc = conn.put(request_id, from_stage, to_stage, payload)   # small, picklable
    payload = conn.get(desc, timeout=10.0)                       # ConnectorTimeout / ConnectorError
    conn.release(desc)

This package never imports vLLM (the KV-connector registration module imports it lazily).
"""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorTimeout,
    PayloadDescriptor,
    StageConnector,
)
from vllm_omni_plugin.connectors.stats import (
    ConnectorStats,
    register_prometheus,
    set_remote_snapshot,
)

CONNECTOR_KINDS = ("inproc", "shm", "nixl")


def make_connector(kind: str, name: str | None = None, **options: Any) -> StageConnector:
    """Build a connector of `kind`; `name` labels its metrics (defaults to the kind).

    Options (all optional): every kind takes `lease_s`. shm: `shm_dir`, `device`.
    nixl: `device`, `agent_name` (fix it to keep one name across restarts), `send_pool_mb`,
    `recv_pool_mb`, `copy_threshold_mb`, `poll_interval_s`, `progress_delay_us` (NIXL progress
    thread sleep between polls; 0 = NIXL's busy loop), `backends`. A NIXL producer can build a
    payload in `conn.empty(shape, dtype)` (inside its registered send pool): put() then needs no
    copy and no registration, the fastest path on one host.
    """
    if kind == "inproc":
        from vllm_omni_plugin.connectors.inproc import InProcConnector

        return InProcConnector(name, **options)
    if kind == "shm":
        from vllm_omni_plugin.connectors.shm import ShmConnector

        return ShmConnector(name, **options)
    if kind == "nixl":
        from vllm_omni_plugin.connectors.nixl import NixlConnector

        return NixlConnector(name, **options)
    raise ValueError(
        f"unknown connector kind {kind!r}; expected one of {', '.join(CONNECTOR_KINDS)}"
    )


def register_kv_connector() -> bool:
    """Register `OmniStageNixlConnector` with vLLM's KVConnectorFactory (see kv_connector.py)."""
    from vllm_omni_plugin.connectors.kv_register import register_kv_connector as _register

    return _register()


__all__ = [
    "CONNECTOR_KINDS",
    "ConnectorError",
    "ConnectorStats",
    "ConnectorTimeout",
    "PayloadDescriptor",
    "StageConnector",
    "make_connector",
    "register_kv_connector",
    "register_prometheus",
    "set_remote_snapshot",
]
