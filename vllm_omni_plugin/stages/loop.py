"""The stage process's loop: one base for every kind of stage.

`StageLoop` owns what every stage process does the same way: the control socket, dispatch of
the orchestrator's messages (Submit, Abort, Shutdown, Inspect, and a final streamed output's
Credit), pulses for the stall watchdog, inspections and replies. A kind of stage only
drives its engine, in one of two shapes:

* `SteppedStageLoop` (the diffusion stage): a synchronous loop that takes what arrived on the
  socket, runs one engine step, and sends what finished; it blocks on the socket only when
  idle. A subclass implements `start_request`, `drop_request`, `has_work`, `step` (and
  optionally `hold_s`, `held`).
* `AsyncStageLoop` (the AR stage, and any stage whose engine is asyncio-native): one asyncio
  task per request running `run_request(msg) -> Result`; the base turns a refusal or an error
  into an error Result, cancels the task on Abort, and streams (stages/streams.py): a producer
  `await self.emit_chunk(msg, payload)` for each piece of output, a consumer reads
  `async for payload in self.chunks(msg, from_stage)`; its streamed edges to and from other
  stages are channels of their own, served on its loop (stages/edge_streams.py).
  `background()` lists coroutines that run beside the requests (an engine watchdog, a
  metrics timer). Only an asyncio stage takes part in a streamed edge between stages.

A new kind is a small subclass: its `__init__` builds the engine, `info()` says what it runs,
and the request hooks drive it (tests/streaming/stream_stages.py is a complete example: two
stages in ~90 lines). The worker (worker.py) picks the subclass from the topology through
loops.py: `StageSpec.runner`, else the kind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import Any

from ..common.messages import (
    PULSE_INTERVAL_S,
    Abort,
    Credit,
    Inspect,
    Inspection,
    Pulse,
    Result,
    Shutdown,
    StageInfo,
    Submit,
)
from ..config.stage_init import StageInit
from .edge_streams import EdgeHub
from .payloads import StagePayloads
from .streams import StageStreams, StreamError, StreamUnavailable

logger = logging.getLogger("vllm_omni_plugin.stages")


class StageLoop(ABC):
    """Socket, dispatch, pulses, inspection and replies; subclasses drive the engine."""

    def __init__(self, init: StageInit, conn: Any):
        self.init = init
        self.conn = conn
        self.stage_id: int = init.stage.stage_id
        self.kind: str = init.spec.kind
        self.payloads = StagePayloads(init.connectors)
        self.streams = StageStreams(self)
        self.submitted = 0  # Submits received (Inspection.submitted)
        self._pulsed = 0.0  # when the last Pulse went out (monotonic)

    # ---- what a kind of stage provides ---------------------------------------------------
    @abstractmethod
    def info(self) -> StageInfo:
        """The Ready info: the kind, what the stage runs (its effective settings), limits."""

    @abstractmethod
    def serve(self) -> None:
        """Run until Shutdown or until the socket closes (EOFError / OSError)."""

    def held(self) -> dict[str, dict[str, int]]:
        """The requests the stage holds now, for Inspection (request id -> facts)."""
        return {}

    def edge_address(self) -> str:
        """Where producers open streamed edges to this stage (its Ready says it; empty: none)."""
        return self.streams.address or ""

    def edge_tcp_address(self) -> str:
        """Where producers on other nodes open streamed edges to this stage (empty: none);
        asked after `edge_address`, which opens the listeners."""
        return self.streams.tcp_address or ""

    def engine_unfinished(self) -> int | None:
        """The engine's own count of unfinished requests, for Inspection (None: unknown)."""
        return None

    def close(self) -> None:
        """Free what the stage holds (connectors, the engine); called once, at exit."""
        self.streams.close()
        self.payloads.close()

    # ---- replies -------------------------------------------------------------------------
    def reply(self, msg: Any) -> None:
        self.conn.send(msg)

    def pulse(self) -> None:
        """Tell the orchestrator's stall watchdog that the engine made progress. Call it from
        the loop that does the work (a stuck engine then stops the pulses), as often as you
        like: at most one Pulse per PULSE_INTERVAL_S goes out."""
        now = time.monotonic()
        if now - self._pulsed >= PULSE_INTERVAL_S:
            self._pulsed = now
            self.reply(Pulse(self.stage_id))

    # ---- dispatch ------------------------------------------------------------------------
    def dispatch(self, msg: Any) -> None:
        if isinstance(msg, Submit):
            self.submitted += 1
            try:
                self.streams.open(msg)
            except StreamError as exc:
                self.streams.drop(msg.request_id)
                self.reply(Result(msg.request_id, error=str(exc)))
                return
            self.on_submit(msg)
        elif isinstance(msg, Abort):
            self.on_abort(msg.request_id)
            self.streams.drop(msg.request_id)
            # Also sent when the request failed or was cancelled after this stage finished it:
            # free its payload now rather than when the connector's lease expires.
            self.payloads.release_request(msg.request_id)
        elif isinstance(msg, Credit):
            self.streams.on_credit(msg)
        elif isinstance(msg, Shutdown):
            self.stop()
        elif isinstance(msg, Inspect):
            self.reply(
                Inspection(
                    msg.token,
                    self.stage_id,
                    self.held(),
                    engine_unfinished=self.engine_unfinished(),
                    submitted=self.submitted,
                    at=time.time(),
                )
            )
        else:
            logger.error("stage %d: unexpected %s", self.stage_id, type(msg).__name__)

    @abstractmethod
    def on_submit(self, msg: Submit) -> None: ...

    @abstractmethod
    def on_abort(self, request_id: str) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...


class SteppedStageLoop(StageLoop):
    """A synchronous engine stepped by this loop (see the module docstring)."""

    def __init__(self, init: StageInit, conn: Any):
        super().__init__(init, conn)
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    def hold_s(self) -> float | None:
        """While busy: how long to wait for more messages before the next step (0: none)."""
        return 0.0

    @abstractmethod
    def has_work(self) -> bool: ...

    @abstractmethod
    def step(self) -> None:
        """Run one engine step and send what finished (Results, Progress)."""

    def serve(self) -> None:
        while not self._stop:
            busy = self.has_work()
            # Idle: block for work. Busy: take whatever arrived, then run one step.
            if self.conn.poll(self.hold_s() if busy else None):
                self.dispatch(self.conn.recv())
                while not self._stop and self.conn.poll(0):
                    self.dispatch(self.conn.recv())
            if not self._stop and self.has_work():
                self.step()
                self.pulse()


class RequestRefused(Exception):
    """A request the stage refuses as the client's fault (HTTP 400), naming the field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class AsyncStageLoop(StageLoop):
    """An asyncio engine: one task per request (see the module docstring)."""

    def __init__(self, init: StageInit, conn: Any):
        super().__init__(init, conn)
        self.loop = asyncio.new_event_loop()
        self.tasks: dict[str, asyncio.Task] = {}
        self._side: list[asyncio.Task] = []  # the background() tasks while serving
        self._done: asyncio.Future | None = None

    @abstractmethod
    async def run_request(self, msg: Submit) -> Result:
        """Drive the engine for one request and return its Result (output, metrics). Raise
        RequestRefused (or a type `refusal` recognises) for the client's errors; cancelled on
        Abort."""

    def refusal(self, exc: Exception) -> tuple[str, str | None] | None:
        """(message, field) when `exc` is the client's fault (a 400), else None."""
        if isinstance(exc, RequestRefused):
            return exc.message, exc.field
        return None

    def on_request_error(self, msg: Submit, exc: Exception) -> bool:
        """Called for an unexpected error of a request; True: send no Result (e.g. the
        stage is exiting and its death fails the request)."""
        return False

    def background(self) -> list:
        """Coroutines that run beside the requests while the stage serves."""
        return []

    # ---- the loop ------------------------------------------------------------------------
    def serve(self) -> None:
        self._done = self.loop.create_future()
        self.edge_address()
        assert self.streams.hub is not None
        self.streams.hub.start(self.loop)
        fd = self.conn.fileno()
        self.loop.add_reader(fd, self._on_readable)
        self._side = [self.loop.create_task(c) for c in self.background()]
        for task in self._side:
            task.add_done_callback(_log_task_failure)
        try:
            self.loop.run_until_complete(self._done)
        finally:
            self.loop.remove_reader(fd)

    async def close_engine(self) -> None:
        """Stop the engine, on the stage's loop (its requests and background tasks are done
        by then); asyncio engines whose own tasks live on this loop stop them here."""

    def close(self) -> None:
        """Wind down on the loop, in order, so no task is left pending when the loop closes
        (asyncio would log each as "Task was destroyed but it is pending!", and a coroutine
        closed that way sees GeneratorExit in the middle of its work): the requests first (an
        AsyncLLM generation aborts its request in the engine as it is cancelled, which needs
        the engine), then the background tasks, then the engine, then whatever is left."""
        if not self.loop.is_closed():
            try:
                self.loop.run_until_complete(self._wind_down())
            except Exception:  # the stage is exiting either way: say why it was not clean
                logger.exception("stage %d: shutdown failed", self.stage_id)
            finally:
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.close()
        super().close()

    async def _wind_down(self) -> None:
        await _cancel_all(list(self.tasks.values()))
        self.tasks.clear()
        await _cancel_all(self._side)
        await self.close_engine()
        me = asyncio.current_task()
        await _cancel_all([t for t in asyncio.all_tasks() if t is not me])

    def stop(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def fatal(self, why: str) -> None:
        """Stop serving with an error: the worker exits non-zero and the orchestrator fails
        the in-flight requests (503) and restarts the stage."""
        if self._done is not None and not self._done.done():
            logger.critical("stage %d: %s; exiting to be restarted", self.stage_id, why)
            self._done.set_exception(RuntimeError(f"stage {self.stage_id}: {why}"))

    def _on_readable(self) -> None:
        try:
            while self.conn.poll(0):
                self.dispatch(self.conn.recv())
        except (EOFError, OSError):
            # The API server is gone: stop (the finally in worker.main cleans up).
            if self._done is not None and not self._done.done():
                self._done.set_exception(EOFError())

    def on_submit(self, msg: Submit) -> None:
        task = self.loop.create_task(self._run(msg))
        task.add_done_callback(_log_task_failure)
        self.tasks[msg.request_id] = task

    def on_abort(self, request_id: str) -> None:
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def edge_address(self) -> str:
        # Listening from the Ready on (its address goes out in it), once the engine is built:
        # an engine process forked earlier does not inherit the listening socket.
        if self.streams.hub is None:
            self.streams.hub = EdgeHub(
                self,
                f"stage{self.stage_id}",
                nixl_min_bytes=self.init.stage.connector.stream_nixl_min_bytes,
            )
        return self.streams.hub.address

    def held(self) -> dict[str, dict[str, int]]:
        """Its running requests, and any request whose streams or channels it still holds
        (with their chunk counts)."""
        rids = {*self.tasks, *self.streams.requests()}
        return {rid: self.streams.facts(rid) for rid in rids}

    async def _run(self, msg: Submit) -> None:
        t0 = time.perf_counter()
        rid = msg.request_id
        ok = False
        try:
            result = await self.run_request(msg)  # its Result ends its output stream
            ok = result.error is None
        except asyncio.CancelledError:
            return  # aborted: the Abort released what the request held
        except Exception as exc:
            refused = self.refusal(exc)
            if refused is not None:
                result = Result(rid, error=refused[0], error_field=refused[1])
            else:
                logger.exception("request %s failed", rid)
                result = Result(
                    rid,
                    error=f"{type(exc).__name__}: {exc}",
                    unavailable=isinstance(exc, StreamUnavailable),
                )
                if self.on_request_error(msg, exc):
                    return
        finally:
            self.tasks.pop(rid, None)
            first_at = self.streams.finish(rid, ended=ok)
        result.stage_s = time.perf_counter() - t0
        if first_at is not None:
            result.first_output_s = first_at - t0
        self.reply(result)

    # ---- streamed edges (stages/streams.py) -------------------------------------------------
    async def emit_chunk(self, msg: Submit, payload: Any) -> int:
        """Emit the next chunk of this request's output (its sequence number); waits while
        the request has its window of unconsumed chunks out (back-pressure)."""
        return await self.streams.emit(msg, payload)

    def chunks(self, msg: Submit, from_stage: int):
        """The chunks of `from_stage`'s output for this request, in order, as an async
        iterator; each chunk's buffer is released as it is read, and the producer may send
        the next one once the consumer asks for it."""
        return self.streams.read(msg, from_stage)


# How long cancelled tasks get to finish at shutdown; the orchestrator gives the whole stage
# StageProcess.shutdown's timeout before it kills the process group.
CANCEL_WAIT_S = 2.0


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel `tasks` and wait (CANCEL_WAIT_S at most) until each has finished."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, stuck = await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
    for task in stuck:
        logger.error("task %s did not finish within %.0f s of its cancel", task, CANCEL_WAIT_S)


def _log_task_failure(task: asyncio.Task) -> None:
    # `_run` turns request errors into Results; what still escapes (the reply's send) would
    # otherwise surface only as asyncio's "exception was never retrieved" at GC time.
    if not task.cancelled() and task.exception() is not None:
        logger.error("stage task failed", exc_info=task.exception())
