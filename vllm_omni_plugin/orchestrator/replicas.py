"""Several replicas of one stage behind one stage client's face: least outstanding requests.

The orchestrator holds one StageHandle (handle.py) per stage; a ReplicaSet is such a handle
whose replicas are themselves stage handles (today Ray actors, ray_backend.py).

* Routing: each request goes to the ready replica with the fewest requests in flight; ties go
  round-robin, so an idle pipeline still spreads its requests.
* A replica that dies fails its in-flight requests with ReplicaLostError. The set retries such a
  request once on another ready replica when that is safe, else the 503 stands. Safe means the
  request's whole input is in the request itself (an entry stage such as Qwen-Image's or FLUX's
  DiT): nothing was consumed, and a request with a fixed seed gets exactly the image the dead
  replica would have returned (without a seed, an equally random one). A stage fed by another
  stage's payload is not retried: the dead replica may already have read, and so released, it.
* Streamed requests (streaming.py) are pinned: the orchestrator asks every stage for the
  request's replica first (`route`), the least loaded of each, and sends the request's Submit,
  its channels' address and its Credits to that replica only, so its chunks stay within that
  chain of replicas (picking each stage's least loaded replica picks the least loaded chain).
  Such a request is never retried: its chunks may have reached the caller or the next stage;
  nor is any request whose output (a chat stage's text) reached the caller.
* Health and restarts stay with each replica (Ray restarts an actor); the set is ready while
  any replica is, and its counters are the sums of its replicas'.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from ..common.limits import RequestLimits
from ..common.messages import Progress, Result, StageInfo, Submit
from .errors import StageUnavailableError
from .handle import ReplicaStats, StageHandle, StageState, StageStats

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

# Requests whose replica is remembered for a late abort (a producer releases its payload when
# the request fails further down the pipeline, after its own reply).
ROUTES_KEPT = 4096


class ReplicaLostError(StageUnavailableError):
    """The replica holding the request died (or became unreachable) before it answered."""


class ReplicaSet:
    def __init__(self, stage_id: int, kind: str, replicas: list[StageHandle], retry_lost: bool):
        self.stage_id = stage_id
        self.kind = kind
        self.replicas = replicas
        self.retry_lost = retry_lost  # see the module docstring: entry stages only
        self.retried = 0
        self._routes: OrderedDict[str, StageHandle] = OrderedDict()
        self._turn = itertools.count()

    # ---- the StageHandle face (handle.py) ------------------------------------------------
    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas)

    @property
    def state(self) -> StageState:
        """READY while any replica is; else the first replica's state."""
        if self.ready:
            return StageState.READY
        return self.replicas[0].state if self.replicas else StageState.STOPPED

    def describe_state(self) -> str:
        up = sum(r.ready for r in self.replicas)
        return f"{up} of {len(self.replicas)} replicas ready"

    def describe(self) -> StageInfo | None:
        return next((i for r in self.replicas if (i := r.describe()) is not None), None)

    def limits(self) -> RequestLimits | None:
        return next((lim for r in self.replicas if (lim := r.limits()) is not None), None)

    @property
    def pid(self) -> int | None:
        return None  # one per replica: replica_stats()

    @property
    def load(self) -> int:
        return sum(r.load for r in self.replicas)

    def stats(self) -> StageStats:
        """The sums of the replicas' own counters."""
        each = [r.stats() for r in self.replicas]
        return StageStats(
            self.ready,
            sum(s.restarts for s in each),
            sum(s.deaths for s in each),
            sum(s.stalls for s in each),
            sum(s.completed for s in each),
            sum(s.failed for s in each),
            sum(s.in_flight for s in each),
            sum(s.busy_s for s in each),
            cache_skipped=dict(sum((Counter(s.cache_skipped) for s in each), Counter())),
            first_output_s=sum(s.first_output_s for s in each),
            first_outputs=sum(s.first_outputs for s in each),
        )

    def replica_stats(self) -> list[ReplicaStats]:
        out = []
        for i, r in enumerate(self.replicas):
            s = r.stats()
            out.append(ReplicaStats(i, s.node, r.pid, s.up, s.restarts, s.completed, s.in_flight))
        return out

    def engine_metrics(self) -> list:
        return []

    async def inspect(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        return None  # several processes: no one answer

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
    @property
    def streams(self) -> bool:
        return all(r.streams for r in self.replicas)

    @property
    def edge_address(self) -> str | None:
        """A ready replica's (each streamed request uses its own replica's: `route`)."""
        return next((r.edge_address for r in self.replicas if r.ready), None)

    def send_stream(self, msg: Any) -> None:
        replica = self._routes.get(msg.request_id)
        if replica is not None:
            replica.send_stream(msg)

    def set_waiting(self, request_id: str, waiting: bool) -> None:
        replica = self._routes.get(request_id)
        if replica is not None:
            replica.set_waiting(request_id, waiting)

    def route(self, request_id: str) -> StageHandle:
        """Pin the request to the ready replica with the fewest requests in flight."""
        replica = self._pick(exclude=[])
        if replica is None:
            raise StageUnavailableError(self._none_ready())
        self._remember(request_id, replica)
        return replica

    def _none_ready(self) -> str:
        return (
            f"stage {self.stage_id} ({self.kind}): none of its {len(self.replicas)} replicas "
            f"is ready ({self.describe_state()})"
        )

    async def submit(
        self,
        msg: Submit,
        on_progress: Callable[[Progress], None] | None = None,
        on_stream: Any = None,
    ) -> Result:
        tried: list[Any] = []
        # Whether any of the request's output (a chat stage's text, a final stage's chunks)
        # reached the caller: then it is never retried. Progress is only a report: a retried
        # request reports its steps again.
        relayed: list[bool] = []

        def progress(out: Any) -> None:
            if not isinstance(out, Progress):
                relayed.append(True)
            if on_progress is not None:
                on_progress(out)

        def stream(chunk: Any) -> None:
            relayed.append(True)
            on_stream(chunk)

        while True:
            replica = self._pick(exclude=tried)
            if replica is None:
                raise StageUnavailableError(self._none_ready())
            tried.append(replica)
            self._remember(msg.request_id, replica)
            try:
                return await replica.submit(
                    msg,
                    on_progress=progress,
                    on_stream=stream if on_stream is not None else None,
                )
            except ReplicaLostError as exc:
                streamed = getattr(msg, "stream_output", False) or getattr(
                    msg, "stream_inputs", None
                )
                if relayed or streamed or not self.retry_lost or len(tried) > 1:
                    raise
                if self._pick(exclude=tried) is None:
                    raise
                self.retried += 1
                logger.warning("%s; retrying %s on another replica", exc, msg.request_id)

    def cancel(self, request_id: str) -> None:
        replica = self._routes.get(request_id)
        if replica is not None:
            replica.cancel(request_id)

    def _pick(self, exclude: list[StageHandle]) -> StageHandle | None:
        """The ready replica with the fewest requests in flight (ties: round-robin)."""
        ready = [r for r in self.replicas if r.ready and r not in exclude]
        if not ready:
            return None
        start = next(self._turn) % len(ready)
        rotated = ready[start:] + ready[:start]
        return min(rotated, key=lambda r: r.load)

    def _remember(self, request_id: str, replica: StageHandle) -> None:
        self._routes[request_id] = replica
        self._routes.move_to_end(request_id)
        while len(self._routes) > ROUTES_KEPT:
            self._routes.popitem(last=False)
