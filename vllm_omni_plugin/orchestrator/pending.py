"""The requests in flight on one stage handle: their futures, progress listeners, the stall
clock and the counters. One helper for every kind of handle (handle.py), so a death, a stall or
a shutdown fails requests the same way wherever the stage runs.

* `run` registers a request, sends it, and waits for its Result; cancelling the wait (the
  client went away) cancels the request in the stage.
* The handle's reader calls `resolve` (a Result), `progress` (a Progress, to the request's
  listener), `fail` (one request) or `fail_all` (the stage died or stalled).
* The stall clock: any work message the stage sends (`touch`) counts as progress; it only runs
  while requests are in flight (`stalled`), and restarts when the first request arrives at an
  idle stage. On a streamed edge (stages/streams.py) a request may wait on another stage: a
  consumer that read every chunk it was given, a producer whose window is full. Such a
  request is `set_waiting` (the stage says so with a StreamWait; the caller's credits for a
  final stage's chunks say so here): it keeps no clock running, and the clock restarts when
  it gets work again, so the watchdog acts per chunk as it does per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..common.messages import Progress, Result
from .errors import StageUnavailableError

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

# When the stage's config does not say (a stub StageInit in a unit test): RuntimeOwner's default.
DEFAULT_STALL_TIMEOUT_S = 300.0


def stall_timeout_of(stage_config: Any) -> float:
    """The stage's `runtime.stall_timeout_s` (its config), or the default."""
    runtime = getattr(stage_config, "runtime", None)
    return float(getattr(runtime, "stall_timeout_s", None) or DEFAULT_STALL_TIMEOUT_S)


class PendingRequests:
    def __init__(self, stall_timeout_s: float):
        self.stall_timeout_s = stall_timeout_s
        self.futures: dict[str, asyncio.Future[Result]] = {}
        self.listeners: dict[str, Callable[[Progress], None]] = {}
        # A final stage's streamed output: request id -> callback for its Chunk messages.
        self.streams: dict[str, Callable[[Any], None]] = {}
        self.waiting: set[str] = set()  # requests waiting on another stage (see above)
        self.last_progress = time.monotonic()
        self.completed = 0
        self.failed = 0
        self.busy_s = 0.0
        self.cache_skipped: Counter[str] = Counter()  # diffusion step caching, per policy
        # Streamed outputs: the summed time from a stage's receipt to its first chunk, and
        # how many requests it covers.
        self.first_output_s = 0.0
        self.first_outputs = 0

    def __len__(self) -> int:
        return len(self.futures)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.futures

    def __bool__(self) -> bool:
        return bool(self.futures)

    # ---- the caller's side ---------------------------------------------------------------
    async def run(
        self,
        request_id: str,
        send: Callable[[], None],
        cancel: Callable[[str], None],
        unreachable: str,
        on_progress: Callable[[Progress], None] | None = None,
        on_stream: Callable[[Any], None] | None = None,
    ) -> Result:
        """Register the request, `send` it, await its Result and count it. OSError from `send`
        is StageUnavailableError(`unreachable`) with nothing left behind."""
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        if not self.futures:  # the stage was idle: its silence so far was no stall
            self.touch()
        self.futures[request_id] = fut
        if on_progress is not None:
            self.listeners[request_id] = on_progress
        if on_stream is not None:
            self.streams[request_id] = on_stream
        try:
            send()
        except OSError:
            self.futures.pop(request_id, None)
            self._forget(request_id)
            raise StageUnavailableError(unreachable) from None
        try:
            result = await fut
        except asyncio.CancelledError:
            # The client went away: drop the request's work in this stage too.
            self.futures.pop(request_id, None)
            cancel(request_id)
            raise
        finally:
            self._forget(request_id)
        self.busy_s += result.stage_s
        if result.first_output_s is not None:
            self.first_output_s += result.first_output_s
            self.first_outputs += 1
        policy = result.metrics.get("cache_policy") if result.metrics else None
        if policy:
            self.cache_skipped[policy] += int(result.metrics.get("cache_skipped", 0))
        if result.error is None:
            self.completed += 1
        else:
            self.failed += 1
        return result

    def _forget(self, request_id: str) -> None:
        self.listeners.pop(request_id, None)
        self.streams.pop(request_id, None)
        self.waiting.discard(request_id)

    def set_waiting(self, request_id: str, waiting: bool) -> None:
        """Mark a request as waiting on another stage (its clock stops), or as having work
        again (the clock restarts now)."""
        if waiting:
            if request_id in self.futures:  # a late report of a finished request: no entry
                self.waiting.add(request_id)
        elif request_id in self.waiting:
            self.waiting.discard(request_id)
            self.touch()

    # ---- the stage's side (the handle's reader, on the loop) -------------------------------
    def touch(self) -> None:
        """The stage showed progress (a work message arrived)."""
        self.last_progress = time.monotonic()

    def resolve(self, result: Result) -> None:
        self.touch()
        fut = self.futures.pop(result.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(result)

    def progress(self, msg: Progress) -> None:
        self.touch()
        listener = self.listeners.get(msg.request_id)
        if listener is None:
            return
        try:
            listener(msg)
        except Exception:  # a consumer's bug must not take the stage's reader down
            logger.exception("progress listener of %s failed", msg.request_id)

    def stream(self, msg: Any) -> None:
        """A final stage's Chunk: progress, handed to the request's relay."""
        self.touch()
        relay = self.streams.get(msg.request_id)
        if relay is None:
            return
        try:
            relay(msg)
        except Exception:  # a relay's bug must not take the stage's reader down
            logger.exception("stream relay of %s failed", msg.request_id)

    def fail(self, request_id: str, exc: BaseException) -> None:
        fut = self.futures.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)
            self.failed += 1

    def fail_all(self, why: str, error: type[StageUnavailableError] = StageUnavailableError):
        """Fail every request in flight with `error(why)` (a 503)."""
        futures, self.futures = self.futures, {}
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(error(why))
        self.failed += len(futures)

    # ---- the stall clock ---------------------------------------------------------------
    def silent_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.last_progress

    def stalled(self, now: float | None = None, grace_s: float = 0.0) -> bool:
        """Requests are in flight and the stage showed no progress for its deadline (+grace)."""
        if self.silent_s(now) <= self.stall_timeout_s + grace_s:
            return False
        return any(rid not in self.waiting for rid in self.futures)
