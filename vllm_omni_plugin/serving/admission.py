"""Bounded work: how many requests a deployment holds at once, and a 429 beyond that.

A request is admitted when it arrives (before its body is read or its uploads decoded). An
admitted request either runs (it has been handed to the stages; at most `running` at once, the
final stage's batch capacity) or waits for a running slot; at most `queued` wait
(`serving.max_queued_requests`). A request that finds both full gets 429 in OpenAI's error shape
with `Retry-After`, and nothing of it is kept. Every admitted request leaves through `release`,
whatever its outcome, so a slot is never lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.responses import StreamingResponse

from .errors import APIError

RETRY_AFTER_S = 1


class Admission:
    """One per deployment and kind of work (image requests). Event-loop only (not threadsafe)."""

    def __init__(self, running: int, queued: int, setting: str) -> None:
        self.running = running
        self.queued = queued
        self.setting = setting  # the config field named in the 429
        self.admitted = 0  # running + waiting
        self.started = 0  # running
        self.rejected = 0
        self._slots: asyncio.Semaphore | None = None

    def admit(self) -> Ticket:
        """A ticket for a new request, or APIError 429 when `running + queued` are held."""
        if self.admitted >= self.running + self.queued:
            self.rejected += 1
            raise too_busy(
                f"the server is at capacity ({self.running} running, {self.queued} queued, "
                f"{self.setting}); retry after {RETRY_AFTER_S} s"
            )
        self.admitted += 1
        return Ticket(self)

    @property
    def waiting(self) -> int:
        return self.admitted - self.started

    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.running)
        return self._slots


class Ticket:
    """An admitted request's place: `await start()` before handing it to the stages (waits for
    a running slot), `release()` when it is over (idempotent)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._running = False
        self._released = False

    async def start(self) -> None:
        if self._running or self._released:
            return
        await self._admission._semaphore().acquire()
        if self._released:  # released while it waited (the request was cancelled)
            self._admission._semaphore().release()
            return
        self._running = True
        self._admission.started += 1

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._admission.admitted -= 1
        if self._running:
            self._running = False
            self._admission.started -= 1
            self._admission._semaphore().release()


def too_busy(message: str) -> APIError:
    return APIError(
        429,
        message,
        code="too_many_requests",
        type="rate_limit_error",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class ReleasingStream(StreamingResponse):
    """A StreamingResponse that calls `release` when it is over, however it ends (the stream's
    own `finally` does not run when the client left before its first chunk)."""

    def __init__(self, content: Any, release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
