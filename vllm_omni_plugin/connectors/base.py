"""The stage connector contract: put a payload, hand a small descriptor to the next stage, get it.

A producer stage calls `put(request_id, from_stage, to_stage, payload)` and sends the returned
`PayloadDescriptor` (common/payload.py, a typed msgspec struct) through the control path. The consumer stage calls
`get(descriptor, timeout)`, which returns a payload of the same type, then `release(descriptor)`.
The producer keeps the payload alive until it is released or its lease expires, whichever first.

No call may block past its own deadline: transports that have no timeouts (NIXL) are wrapped so a
dead or hung peer becomes a `ConnectorError` / `ConnectorTimeout` instead of a hang.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any

from vllm_omni_plugin.common.payload import PAYLOAD_KINDS, PayloadDescriptor, PayloadKind
from vllm_omni_plugin.connectors.stats import ConnectorStats

__all__ = ["ConnectorError", "ConnectorTimeout", "PayloadDescriptor", "PayloadKind"]

logger = logging.getLogger("vllm_omni_plugin.connectors")


class ConnectorError(RuntimeError):
    """A payload could not be handed over (peer dead, payload released or expired, bad input)."""


class ConnectorTimeout(ConnectorError, TimeoutError):
    """A get did not finish within its deadline (e.g. the peer hangs)."""


def new_key(request_id: str, from_stage: int, to_stage: int) -> str:
    # The random suffix keeps keys unique when a request puts several payloads on one edge.
    return f"{request_id}:{from_stage}->{to_stage}:{uuid.uuid4().hex[:12]}"


class Deadline:
    """A monotonic deadline; every wait in the connectors is bounded by one of these."""

    def __init__(self, timeout: float):
        if timeout is None or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.at = time.monotonic() + self.timeout

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.at


class StageConnector(ABC):
    """Base class of all connectors. Subclasses set `kind` and implement the four operations."""

    kind: str = "base"

    def __init__(self, name: str | None = None, lease_s: float = 300.0):
        self.name = name or self.kind
        self.lease_s = float(lease_s)
        self.stats: ConnectorStats = ConnectorStats.for_name(self.name)

    @abstractmethod
    def put(
        self, request_id: str, from_stage: int, to_stage: int, payload: Any
    ) -> PayloadDescriptor:
        """Store the payload for one edge of one request and return its descriptor."""

    def _described_put(
        self,
        key: str,
        request_id: str,
        from_stage: int,
        to_stage: int,
        kind: PayloadKind,
        dtype: str | None,
        shape: tuple[int, ...],
        nbytes: int,
        location: Any = None,
    ) -> PayloadDescriptor:
        """Count one finished put and return its descriptor (shared by every connector kind)."""
        self.stats.record_put(nbytes)
        return PayloadDescriptor(
            self.kind,
            self.name,
            key,
            request_id,
            from_stage,
            to_stage,
            kind,
            dtype,
            shape,
            nbytes,
            self.lease_s,
            location=location,
        )

    @abstractmethod
    def get(self, desc: PayloadDescriptor, timeout: float) -> Any:
        """Fetch the payload; raises ConnectorTimeout past `timeout` s, ConnectorError on failure."""

    @abstractmethod
    def release(self, desc: PayloadDescriptor) -> None:
        """Tell the producer the payload is no longer needed (idempotent, never raises)."""

    @abstractmethod
    def health(self) -> bool:
        """True while the connector can move payloads."""

    @abstractmethod
    def close(self) -> None:
        """Free everything this connector holds (idempotent)."""

    def _check_desc(self, desc: PayloadDescriptor) -> None:
        if not isinstance(desc, PayloadDescriptor):
            raise ConnectorError(f"expected a PayloadDescriptor, got {type(desc).__name__}")
        if desc.connector != self.kind:
            raise ConnectorError(
                f"descriptor {desc.key} was made by a {desc.connector!r} connector, "
                f"not {self.kind!r}"
            )
        check_kind(desc.kind, desc.key, desc.request_id)


def check_kind(kind: str, key: str = "-", request_id: str = "-") -> None:
    """Refuse a payload kind outside PAYLOAD_KINDS before anything is fetched or decoded: a
    logged error, then ConnectorError (the one request fails; the stage keeps serving)."""
    if kind not in PAYLOAD_KINDS:
        logger.error(
            "refused payload %s of request %s: kind %r is not one of %s (nothing was read)",
            key,
            request_id,
            kind,
            ", ".join(PAYLOAD_KINDS),
        )
        raise ConnectorError(
            f"payload kind {kind!r} refused: only {', '.join(PAYLOAD_KINDS)} payloads travel"
        )

    def __enter__(self) -> StageConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
