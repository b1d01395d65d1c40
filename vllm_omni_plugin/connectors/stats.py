"""Per-connector counters, and a Prometheus collector that exposes them with `connector=<name>`.

Counters live in plain Python (cheap, no prometheus import on the hot path). A stage process that
is not the API server sends `snapshot()` dicts to it (e.g. with its heartbeat) and the API server
feeds them to `set_remote_snapshot`; `register_prometheus()` then exports local + remote counters.

Exported metrics (role is "producer" for the side that put, "consumer" for the side that got):
  omni_connector_puts_total{connector}
  omni_connector_put_bytes_total{connector}         bytes of those payloads
  omni_connector_transfers_total{connector,role}     completed handoffs seen by that side
  omni_connector_bytes_total{connector,role}
  omni_connector_failures_total{connector,role}      includes timeouts
  omni_connector_timeouts_total{connector}
  omni_connector_expired_total{connector}            payloads freed by lease expiry
  omni_connector_transfer_latency_seconds{connector,role}  histogram (consumer: get time;
                                                     producer: put -> release notification)
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, ClassVar

ROLES = ("producer", "consumer")
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def _zero_role() -> dict[str, Any]:
    return {
        "transfers": 0,
        "bytes": 0,
        "failures": 0,
        "latency_buckets": [0] * (len(LATENCY_BUCKETS) + 1),  # last one is +Inf
        "latency_sum": 0.0,
    }


class ConnectorStats:
    """Thread-safe counters of one connector name (shared by all its instances in a process)."""

    _by_name: ClassVar[dict[str, ConnectorStats]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self.reset()

    @classmethod
    def for_name(cls, name: str) -> ConnectorStats:
        with cls._registry_lock:
            if name not in cls._by_name:
                cls._by_name[name] = cls(name)
            return cls._by_name[name]

    @classmethod
    def all(cls) -> list[ConnectorStats]:
        with cls._registry_lock:
            return list(cls._by_name.values())

    def reset(self) -> None:
        with self._lock:
            self.puts = 0
            self.put_bytes = 0
            self.timeouts = 0
            self.expired = 0
            self.roles = {role: _zero_role() for role in ROLES}

    # -- recording -------------------------------------------------------------------------
    def record_put(self, nbytes: int) -> None:
        with self._lock:
            self.puts += 1
            self.put_bytes += nbytes

    def record_transfer(self, role: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            r = self.roles[role]
            r["transfers"] += 1
            r["bytes"] += nbytes
            r["latency_buckets"][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            r["latency_sum"] += seconds

    def record_failure(self, role: str, timeout: bool = False) -> None:
        with self._lock:
            self.roles[role]["failures"] += 1
            self.timeouts += int(timeout)

    def record_expired(self) -> None:
        with self._lock:
            self.expired += 1

    # -- reading ---------------------------------------------------------------------------
    @property
    def transfers(self) -> int:
        return self.roles["consumer"]["transfers"]

    @property
    def failures(self) -> int:
        return sum(r["failures"] for r in self.roles.values())

    def snapshot(self) -> dict[str, Any]:
        """A plain picklable/JSON-able dict of every counter."""
        with self._lock:
            return {
                "name": self.name,
                "puts": self.puts,
                "put_bytes": self.put_bytes,
                "timeouts": self.timeouts,
                "expired": self.expired,
                "roles": {
                    role: {**r, "latency_buckets": list(r["latency_buckets"])}
                    for role, r in self.roles.items()
                },
            }


# -- Prometheus export ----------------------------------------------------------------------
_remote: dict[str, dict[str, Any]] = {}  # source id -> {connector name: snapshot}
_remote_lock = threading.Lock()
_registered: set[int] = set()


def set_remote_snapshot(source: str, snapshots: list[dict[str, Any]]) -> None:
    """Record the latest `snapshot()` list from another process (replaces that source's last)."""
    with _remote_lock:
        _remote[source] = {s["name"]: s for s in snapshots}


def all_snapshots() -> list[dict[str, Any]]:
    """Local and remote snapshots, summed per connector name."""
    merged: dict[str, dict[str, Any]] = {}
    with _remote_lock:
        remote = [s for per_source in _remote.values() for s in per_source.values()]
    for snap in [s.snapshot() for s in ConnectorStats.all()] + remote:
        into = merged.setdefault(
            snap["name"],
            {
                "name": snap["name"],
                "puts": 0,
                "put_bytes": 0,
                "timeouts": 0,
                "expired": 0,
                "roles": {role: _zero_role() for role in ROLES},
            },
        )
        for field in ("puts", "put_bytes", "timeouts", "expired"):
            into[field] += snap[field]
        for role in ROLES:
            src, dst = snap["roles"][role], into["roles"][role]
            for field in ("transfers", "bytes", "failures", "latency_sum"):
                dst[field] += src[field]
            dst["latency_buckets"] = [
                a + b for a, b in zip(dst["latency_buckets"], src["latency_buckets"], strict=True)
            ]
    return list(merged.values())


class _Collector:
    """Reads the counters at scrape time, so nothing is created before a connector exists."""

    def collect(self):  # noqa: ANN201 (prometheus_client protocol)
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        snaps = all_snapshots()
        puts = CounterMetricFamily("omni_connector_puts", "Payloads put", labels=["connector"])
        put_bytes = CounterMetricFamily(
            "omni_connector_put_bytes", "Bytes of the payloads put", labels=["connector"]
        )
        timeouts = CounterMetricFamily(
            "omni_connector_timeouts", "Gets past their deadline", labels=["connector"]
        )
        expired = CounterMetricFamily(
            "omni_connector_expired", "Payloads freed by lease expiry", labels=["connector"]
        )
        transfers = CounterMetricFamily(
            "omni_connector_transfers", "Completed payload handoffs", labels=["connector", "role"]
        )
        nbytes = CounterMetricFamily(
            "omni_connector_bytes", "Payload bytes handed off", labels=["connector", "role"]
        )
        failures = CounterMetricFamily(
            "omni_connector_failures", "Failed puts/gets", labels=["connector", "role"]
        )
        latency = HistogramMetricFamily(
            "omni_connector_transfer_latency_seconds",
            "Handoff latency",
            labels=["connector", "role"],
        )
        for s in snaps:
            name = s["name"]
            puts.add_metric([name], s["puts"])
            put_bytes.add_metric([name], s["put_bytes"])
            timeouts.add_metric([name], s["timeouts"])
            expired.add_metric([name], s["expired"])
            for role in ROLES:
                r = s["roles"][role]
                transfers.add_metric([name, role], r["transfers"])
                nbytes.add_metric([name, role], r["bytes"])
                failures.add_metric([name, role], r["failures"])
                cumulative, buckets = 0, []
                for le, count in zip(
                    [*map(str, LATENCY_BUCKETS), "+Inf"], r["latency_buckets"], strict=True
                ):
                    cumulative += count
                    buckets.append((le, cumulative))
                latency.add_metric([name, role], buckets, r["latency_sum"])
        yield from (puts, put_bytes, transfers, nbytes, failures, timeouts, expired, latency)


def register_prometheus(registry: Any = None) -> None:
    """Add the connector collector to `registry` (default: prometheus_client's REGISTRY), once."""
    from prometheus_client import REGISTRY

    registry = registry if registry is not None else REGISTRY
    if id(registry) in _registered:
        return
    registry.register(_Collector())
    _registered.add(id(registry))
