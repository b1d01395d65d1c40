"""Several replicas of one stage behind one stage client's face: least outstanding requests.

The orchestrator holds one client per stage and calls `submit`/`abort` on it; a ReplicaSet is
such a client whose replicas are themselves stage clients (today Ray actors, ray_backend.py).

* Routing: each request goes to the ready replica with the fewest requests in flight; ties go
  round-robin, so an idle pipeline still spreads its requests.
* A replica that dies fails its in-flight requests with ReplicaLostError. The set retries such a
  request once on another ready replica when that is safe, else the 503 stands. Safe means the
  request's whole input is in the request itself (an entry stage such as Qwen-Image's or FLUX's
  DiT): nothing was consumed, and a request with a fixed seed gets exactly the image the dead
  replica would have returned (without a seed, an equally random one). A stage fed by another
  stage's payload is not retried: the dead replica may already have read, and so released, it.
* Health and restarts stay with each replica (Ray restarts an actor); the set is ready while
  any replica is, and its counters are the sums of its replicas'.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..stages.messages import Progress, Result, Submit
from .errors import StageUnavailableError

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

# Requests whose replica is remembered for a late abort (a producer releases its payload when
# the request fails further down the pipeline, after its own reply).
ROUTES_KEPT = 4096


class ReplicaLostError(StageUnavailableError):
    """The replica holding the request died (or became unreachable) before it answered."""


class ReplicaSet:
    def __init__(self, stage_id: int, kind: str, replicas: list[Any], retry_lost: bool):
        self.stage_id = stage_id
        self.kind = kind
        self.replicas = replicas
        self.retry_lost = retry_lost  # see the module docstring: entry stages only
        self.retried = 0
        self._routes: OrderedDict[str, Any] = OrderedDict()
        self._turn = itertools.count()

    # ---- the stage client's face -------------------------------------------------------
    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas)

    @property
    def state(self) -> str:
        up = sum(r.ready for r in self.replicas)
        return f"{up} of {len(self.replicas)} replicas ready"

    @property
    def info(self) -> dict[str, Any]:
        return next((r.info for r in self.replicas if r.info), {})

    @property
    def pid(self) -> int | None:
        return None  # one per replica: replica_stats()

    @property
    def pending(self) -> dict[str, Any]:
        return {rid: f for r in self.replicas for rid, f in r.pending.items()}

    # Counters /metrics reads: the sums of the replicas' own.
    restarts = property(lambda self: self._sum("restarts"))
    deaths = property(lambda self: self._sum("deaths"))
    stalls = property(lambda self: self._sum("stalls"))
    completed = property(lambda self: self._sum("completed"))
    failed = property(lambda self: self._sum("failed"))
    busy_s = property(lambda self: self._sum("busy_s"))

    def _sum(self, counter: str) -> Any:
        return sum(getattr(r, counter, 0) for r in self.replicas)

    def replica_stats(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": i,
                "node": getattr(r, "node_ip", None) or "",
                "pid": r.pid,
                "up": 1.0 if r.ready else 0.0,
                "restarts": r.restarts,
                "completed": r.completed,
                "in_flight": len(r.pending),
            }
            for i, r in enumerate(self.replicas)
        ]

    async def start(self) -> None:
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        """Stop every replica at once (blocking; each may take seconds to stop its stage)."""
        threads = [
            threading.Thread(target=r.shutdown, name=f"omni-stop-replica-{i}")
            for i, r in enumerate(self.replicas)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # ---- requests ----------------------------------------------------------------------
    async def submit(
        self, msg: Submit, on_progress: Callable[[Progress], None] | None = None
    ) -> Result:
        tried: list[Any] = []
        while True:
            replica = self._pick(exclude=tried)
            if replica is None:
                raise StageUnavailableError(
                    f"stage {self.stage_id} ({self.kind}): none of its "
                    f"{len(self.replicas)} replicas is ready ({self.state})"
                )
            tried.append(replica)
            self._remember(msg.request_id, replica)
            try:
                if on_progress is None:
                    return await replica.submit(msg)
                return await replica.submit(msg, on_progress=on_progress)
            except ReplicaLostError as exc:
                if not self.retry_lost or len(tried) > 1 or self._pick(exclude=tried) is None:
                    raise
                self.retried += 1
                logger.warning("%s; retrying %s on another replica", exc, msg.request_id)

    def abort(self, request_id: str) -> None:
        replica = self._routes.get(request_id)
        if replica is not None:
            replica.abort(request_id)

    def _pick(self, exclude: list[Any]) -> Any | None:
        """The ready replica with the fewest requests in flight (ties: round-robin)."""
        ready = [r for r in self.replicas if r.ready and r not in exclude]
        if not ready:
            return None
        start = next(self._turn) % len(ready)
        rotated = ready[start:] + ready[:start]
        return min(rotated, key=lambda r: len(r.pending))

    def _remember(self, request_id: str, replica: Any) -> None:
        self._routes[request_id] = replica
        self._routes.move_to_end(request_id)
        while len(self._routes) > ROUTES_KEPT:
            self._routes.popitem(last=False)
