"""What the orchestrator (and the routes, /metrics, a headless node) may call on a stage.

Every stage, wherever it runs, is one `StageHandle`: a local process (`StageClient`), a stage
on a headless node (`RemoteStageClient`), several replicas behind one face (`ReplicaSet`), or
one Ray actor replica (`RayReplicaClient`). Callers use only this protocol, never probe a
client for optional attributes: what a kind of handle cannot do has a defined answer here
(`inspect` returns None, `engine_metrics` an empty list, `replica_stats` an empty list).

The bookkeeping of requests in flight (futures, progress listeners, the stall clock, the
counters) is one helper every handle shares: pending.py.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..common.limits import RequestLimits
from ..common.messages import Progress, Result, StageInfo, Submit
from .pending import PendingRequests


class StageState(str, enum.Enum):
    """Where a stage handle is in its life. Compares equal to its value ("ready", ...)."""

    STOPPED = "stopped"  # not started yet
    STARTING = "starting"  # a process is being spawned / a replica started
    READY = "ready"  # takes requests
    DYING = "dying"  # a death or stall is being handled (requests fail, process killed)
    DEAD = "dead"  # down, a restart is due (or running)
    WAITING = "waiting"  # remote: no node has registered this stage (yet, or since it left)
    DOWN = "down"  # remote: its node says the stage is not ready; Ray: being restarted
    CLOSED = "closed"  # shut down for good

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StageStats:
    """A handle's counters, as /metrics and the stage description show them."""

    up: bool
    restarts: int
    deaths: int
    stalls: int
    completed: int
    failed: int
    in_flight: int
    busy_s: float
    node: str = ""  # where it runs, when not in this process's host: a node's peer, a Ray IP
    # Diffusion step caching: request steps whose transformer call was skipped, per policy.
    cache_skipped: dict[str, int] = field(default_factory=dict)
    # Streamed outputs: summed seconds from receipt to the first chunk, over `first_outputs`.
    first_output_s: float = 0.0
    first_outputs: int = 0


def pending_stats(
    pending: PendingRequests, up: bool, restarts: int, deaths: int, stalls: int, node: str = ""
) -> StageStats:
    """A single stage's counters: its lifecycle counts and what its pending requests counted."""
    return StageStats(
        up,
        restarts,
        deaths,
        stalls,
        pending.completed,
        pending.failed,
        len(pending),
        pending.busy_s,
        node,
        dict(pending.cache_skipped),
        pending.first_output_s,
        pending.first_outputs,
    )


@dataclass(frozen=True)
class ReplicaStats:
    """One replica of a replicated stage (ReplicaSet), for the per-replica metrics."""

    replica: int
    node: str
    pid: int | None
    up: bool
    restarts: int
    completed: int
    in_flight: int


ProgressListener = Callable[[Progress], None]
StreamListener = Callable[[Any], None]  # a final stage's Chunks for one request


@runtime_checkable
class StageHandle(Protocol):
    """One stage of the pipeline as the orchestrator sees it."""

    stage_id: int
    kind: str  # the topology's stage kind: "ar" | "diffusion" | ...

    @property
    def state(self) -> StageState: ...

    @property
    def ready(self) -> bool:
        """Takes requests now (`state` is READY; a replica set: any replica is)."""
        ...

    @property
    def load(self) -> int:
        """Requests in flight on this stage now (routing and the in-flight gauge)."""
        ...

    @property
    def pid(self) -> int | None:
        """The stage's process id where there is one process (None otherwise)."""
        ...

    def describe(self) -> StageInfo | None:
        """The stage's Ready info: its kind, its limits (final diffusion stages) and the
        effective settings read back from its engine. None until it was first ready; kept
        while it restarts (the limits do not change)."""
        ...

    def limits(self) -> RequestLimits | None:
        """The request limits the stage announced, or None."""
        ...

    async def start(self) -> None: ...

    def shutdown(self) -> None:
        """Stop for good (blocking, any thread but the loop's); in-flight requests fail."""
        ...

    async def submit(
        self,
        msg: Submit,
        on_progress: ProgressListener | None = None,
        on_stream: StreamListener | None = None,
    ) -> Result:
        """Run one request; StageUnavailableError (503) when the stage is down or dies.
        `on_progress` gets the stage's Progress messages for it until its Result, and
        `on_stream` its Chunks (a final streaming stage; only where `streams`)."""
        ...

    @property
    def streams(self) -> bool:
        """Whether this stage takes part in streamed edges (submit's `on_stream`,
        `send_stream`, `edge_address`)."""
        ...

    @property
    def edge_address(self) -> str | None:
        """Where a producer opens a streamed edge's channel to this stage (None: nowhere)."""
        ...

    def send_stream(self, msg: Any) -> None:
        """Hand a final streaming stage the Credit for one of its chunks."""
        ...

    def route(self, request_id: str) -> StageHandle:
        """The handle that serves every message of `request_id` (its Submit, its Credits, its
        channels' address): the handle itself, or the replica a replica set pins the request
        to (StageUnavailableError when none is ready)."""
        ...

    def set_waiting(self, request_id: str, waiting: bool) -> None:
        """The request waits on another stage (streamed edges): its stall clock stops."""
        ...

    def cancel(self, request_id: str) -> None:
        """Drop the request's work and release what the stage emitted for it (never raises)."""
        ...

    def stats(self) -> StageStats: ...

    def replica_stats(self) -> list[ReplicaStats]:
        """Per replica for a replicated stage; empty otherwise."""
        ...

    def engine_metrics(self) -> list:
        """The stage engine's own vLLM metric families (local AR stages); empty otherwise."""
        ...

    async def inspect(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """What the stage holds now, answered by the stage itself; None if it cannot say."""
        ...


def limits_of(info: StageInfo | None) -> RequestLimits | None:
    return None if info is None else info.limits
