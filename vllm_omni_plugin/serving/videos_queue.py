"""The video jobs' waiting line and change notices, both bounded and in memory.

`JobQueue` holds the ids of jobs created and not yet picked up by a worker, oldest first, at
most `videos.max_queued_jobs` of them (429 with Retry-After beyond), and wakes one worker per
job. It also tells the `/events` streams when any job changed, so they wait on an event instead
of polling the store, and counts those streams against `videos.max_event_streams`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .admission import too_busy

HEALTH_POLL_S = 0.2


class JobQueue:
    """Event-loop only."""

    def __init__(self, max_queued: int, max_event_streams: int) -> None:
        self.max_queued = max_queued
        self.max_event_streams = max_event_streams
        self.event_streams = 0
        self._queued: dict[str, None] = {}  # insertion order: oldest first
        # One permit per queued job; a job deleted while queued leaves a spare permit, which
        # finds nothing and is dropped (a counter, so nothing grows).
        self._work: asyncio.Semaphore | None = None
        self._changed: asyncio.Event | None = None

    def __len__(self) -> int:
        return len(self._queued)

    def admit(self) -> None:
        """429 when `videos.max_queued_jobs` jobs already wait."""
        if len(self._queued) >= self.max_queued:
            raise too_busy(
                f"{len(self._queued)} video jobs are already waiting "
                f"(videos.max_queued_jobs = {self.max_queued}); retry later"
            )

    def put(self, job_id: str) -> None:
        self._queued[job_id] = None
        self._permits().release()
        self.notify()

    def discard(self, job_id: str) -> None:
        self._queued.pop(job_id, None)

    async def take(self, healthy: Callable[[], bool]) -> str:
        """The oldest waiting job, once there is one and the pipeline is `healthy()` (a stage
        that is restarting takes no work; waiting jobs wait for it)."""
        while True:
            await self._permits().acquire()
            while not healthy():
                await asyncio.sleep(HEALTH_POLL_S)
            if self._queued:
                job_id = next(iter(self._queued))
                del self._queued[job_id]
                return job_id

    def _permits(self) -> asyncio.Semaphore:
        if self._work is None:
            self._work = asyncio.Semaphore(0)
        return self._work

    # ---- change notices ------------------------------------------------------------------
    def changed(self) -> asyncio.Event:
        """An event set at the next change of any job (status, progress, deletion)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def open_stream(self) -> Callable[[], None]:
        """Count a new `/events` stream (429 past `videos.max_event_streams`); returns the
        function that closes it (idempotent: both the stream and its response call it)."""
        if self.event_streams >= self.max_event_streams:
            raise too_busy(
                f"{self.event_streams} job event streams are open "
                f"(videos.max_event_streams); poll GET /v1/videos/{{id}} or retry later"
            )
        self.event_streams += 1
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                self.event_streams -= 1

        return close
