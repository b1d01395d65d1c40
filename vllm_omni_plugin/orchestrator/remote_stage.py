"""RemoteStageClient: a stage that runs on a headless node, as a StageHandle (handle.py).

The orchestrator sees the same face as a local stage; the head's registry (remote.py) attaches the link of whichever node
registered the stage. With no live node the stage is not ready and `submit` raises
StageUnavailableError at once (HTTP 503); losing the node fails its in-flight requests at once.

The node relays its stages' Progress (streaming requests get their steps from a remote stage
too), Pulses and StreamWaits. Streamed edges: a producer elsewhere opens its channel to the
stage's TCP listener (`edge_address`, from the node's status; the Submit's tokens cross the
link masked, edge_tokens.py), and a final stage's Chunks come over the link, its Credits go
back the same way. A remote stage holding requests that relays neither for its stall_timeout_s
plus STALL_GRACE_S is stuck though its node still heartbeats: the head drops that node's link,
which fails the requests with 503; the node registers again. The grace leaves the first move
to the node's own watchdog, which sees the stage directly and restarts it there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from ..common.limits import RequestLimits
from ..common.link_messages import StageStatus, ToStage, Unavailable
from ..common.messages import Abort, Credit, Progress, Result, StageInfo, StreamWait, Submit
from ..config.stage_init import StageInit
from .edge_tokens import has_tokens, mask_tokens
from .errors import StageUnavailableError
from .handle import ReplicaStats, StageState, StageStats, limits_of, pending_stats
from .link import Link
from .pending import PendingRequests, stall_timeout_of

logger = logging.getLogger("vllm_omni_plugin.orchestrator.remote")

# Beyond the stage's stall_timeout_s before the head gives up on a remote stage: a few of the
# node's heartbeats, so the node's own watchdog (same deadline, no network between) acts first.
STALL_GRACE_S = 3.0


class Head(Protocol):
    """What a remote stage uses of the head that owns it (remote.StageHead, which imports
    this module): its listening port and its event loop."""

    port: int
    authkey: bytes  # the node link's key: masks the edges' tokens

    def call_in_loop(self, fn: Callable[..., Any], *args: Any) -> None: ...


class RemoteStageClient:
    """A stage that runs on a headless node (a StageHandle)."""

    def __init__(self, init: StageInit, head: Head):
        self.init = init
        self.stage_id: int = init.stage.stage_id
        self.kind: str = init.spec.kind
        self.head = head
        self.link: Link | None = None
        self.status: StageStatus | None = None
        self.closed = False
        # Requests in flight, their progress listeners, the stall clock and the counters.
        self.pending = PendingRequests(stall_timeout_of(init.stage))
        self.stalls = 0  # links dropped because the stage stopped producing
        self.registrations = 0
        self.restarts = 0  # re-registrations after the first
        self.deaths = 0  # nodes lost (EOF or missed heartbeats)
        self._info: StageInfo | None = None
        self.waiting: set[str] = set()  # requests whose caller holds the window (set_waiting)

    # ---- the StageHandle face (handle.py) ------------------------------------------------
    def describe(self) -> StageInfo | None:
        return self._info  # kept after the node goes away: the limits do not change

    def limits(self) -> RequestLimits | None:
        return limits_of(self._info)

    @property
    def load(self) -> int:
        return len(self.pending)

    def stats(self) -> StageStats:
        node = self.link.peer if self.link is not None else ""
        return pending_stats(
            self.pending, self.ready, self.restarts, self.deaths, self.stalls, node
        )

    def replica_stats(self) -> list[ReplicaStats]:
        return []

    def engine_metrics(self) -> list:
        return []  # a node does not relay its AR engines' metrics

    async def inspect(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        return None  # the node protocol has no inspection

    @property
    def ready(self) -> bool:
        return (
            not self.closed
            and self.link is not None
            and self.link.alive
            and self.status is not None
            and self.status.ready
        )

    @property
    def pid(self) -> int | None:
        return self.status.pid if self.status else None

    @property
    def state(self) -> StageState:
        if self.closed:
            return StageState.CLOSED
        if self.link is None:
            return StageState.WAITING  # for a node
        return StageState.READY if self.ready else StageState.DOWN  # on its node

    async def start(self) -> None:
        """Nothing to spawn: the head's listener attaches a node when one registers."""
        logger.info(
            "stage %d (%s) is remote: waiting for a node to register on port %s",
            self.stage_id,
            self.kind,
            self.head.port,
        )

    def shutdown(self) -> None:
        self.closed = True
        self.head.call_in_loop(self.pending.fail_all, "the server is shutting down")

    # ---- requests ----------------------------------------------------------------------
    streams = True

    @property
    def edge_address(self) -> str | None:
        """The stage's TCP listener on its node (None: no node, or it takes no streams)."""
        if self.status is None or not self.ready:
            return None
        return self.status.edge_address or None

    def send_stream(self, msg: Any) -> None:
        """A Credit for a final stage's chunk, over the link (a lost node fails the request)."""
        link = self.link
        if link is not None and isinstance(msg, Credit):
            with contextlib.suppress(OSError):
                link.send(ToStage(self.stage_id, msg))

    def route(self, request_id: str) -> RemoteStageClient:
        return self  # one node serves every request

    def set_waiting(self, request_id: str, waiting: bool) -> None:
        """The caller holds the stage's window of chunks (or no longer does): both stall
        clocks stop, the head's and the node's own."""
        self.pending.set_waiting(request_id, waiting)
        if waiting == (request_id in self.waiting):
            return  # the node knows (the caller says so per chunk taken)
        if waiting:
            self.waiting.add(request_id)
        else:
            self.waiting.discard(request_id)
        link = self.link
        if link is not None:
            with contextlib.suppress(OSError):
                link.send(ToStage(self.stage_id, StreamWait(request_id, self.stage_id, waiting)))

    def on_stream_wait(self, msg: StreamWait) -> None:
        """The stage's own report: it waits on a peer stage (or no longer does)."""
        self.pending.set_waiting(msg.request_id, msg.waiting)

    async def submit(
        self,
        msg: Submit,
        on_progress: Callable[[Progress], None] | None = None,
        on_stream: Any = None,
    ) -> Result:
        link = self.link
        if not self.ready or link is None:
            raise StageUnavailableError(
                f"stage {self.stage_id} ({self.kind}) has no live node ({self.state}); "
                f"start one with `vllm serve ... --headless --stage-ids {self.stage_id}`"
            )
        if has_tokens(msg):
            masked, nonce = mask_tokens(msg, self.head.authkey)
            wire = ToStage(self.stage_id, masked, nonce)
        else:
            wire = ToStage(self.stage_id, msg)
        return await self.pending.run(
            msg.request_id,
            lambda: link.send(wire),  # queues for the link's writer thread: never blocks
            self.cancel,
            f"stage {self.stage_id} ({self.kind}): node {link.peer} is unreachable",
            on_progress,
            on_stream,
        )

    def cancel(self, request_id: str) -> None:
        self.waiting.discard(request_id)
        if self.link is not None:
            with contextlib.suppress(OSError):
                self.link.send(ToStage(self.stage_id, Abort(request_id)))

    # ---- called by the head on its loop ------------------------------------------------
    def attach(self, link: Link, status: StageStatus) -> None:
        if self.registrations:
            self.restarts += 1
        self.registrations += 1
        self.link = link
        self.update(status)
        logger.info(
            "stage %d (%s) registered by node %s (ready=%s)",
            self.stage_id,
            self.kind,
            link.peer,
            status.ready,
        )

    def update(self, status: StageStatus) -> None:
        was_ready = self.status is not None and self.status.ready
        self.status = status
        if status.info is not None:
            self._info = status.info
        if was_ready and not status.ready:
            logger.warning("stage %d is down on its node; requests fail fast", self.stage_id)

    def detach(self, link: Link, why: str) -> None:
        if link is not self.link:
            return  # a link that was already replaced
        self.link = None
        self.waiting.clear()
        self.deaths += 1
        n = len(self.pending)
        logger.error(
            "stage %d (%s): node %s lost (%s); failing %d in-flight request(s)",
            self.stage_id,
            self.kind,
            link.peer,
            why,
            n,
        )
        self.pending.fail_all(f"stage {self.stage_id} ({self.kind}): node {link.peer} lost ({why})")

    def owns(self, request_id: str) -> bool:
        return request_id in self.pending

    def on_pulse(self) -> None:
        self.pending.touch()

    def on_progress(self, msg: Progress) -> None:
        self.pending.progress(msg)

    def on_chunk(self, msg: Any) -> None:
        self.pending.stream(msg)

    def check_stall(self, now: float) -> None:
        """Drop the node's link when this stage holds requests but relayed no progress for
        stall_timeout_s + STALL_GRACE_S (see the module doc)."""
        link = self.link
        if link is None or not self.pending.stalled(now, grace_s=STALL_GRACE_S):
            return
        self.stalls += 1
        why = (
            f"stage {self.stage_id} ({self.kind}) made no progress for "
            f"{self.pending.silent_s(now):.0f} s "
            f"(stall_timeout_s {self.pending.stall_timeout_s:g})"
        )
        logger.error("%s on node %s; dropping the node", why, link.peer)
        self.detach(link, why)
        link.drop(why)

    def on_result(self, msg: Result) -> None:
        self.waiting.discard(msg.request_id)
        self.pending.resolve(msg)

    def on_unavailable(self, msg: Unavailable) -> None:
        self.pending.fail(msg.request_id, StageUnavailableError(msg.message))
