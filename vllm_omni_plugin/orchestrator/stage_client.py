"""The asyncio face of one stage: submit a request and await its result; notice death; restart.

A stage that dies (its control socket reads EOF, or the supervisor sees an exit code) fails
every in-flight request at once with StageUnavailableError (HTTP 503), logs the stage id and
exit code, and is restarted in the background with backoff. Requests that arrive while it is
down fail fast instead of queueing behind a restart.

Every start (the first one and each restart) that fails for any reason is logged, the half-started
process killed, and retried with backoff. The first start gives up after STARTUP_ATTEMPTS, or at
once when the stage's engine refused its settings (StageConfigError), and the server then exits
with the error; a restart never gives up. No background task ends silently: a done callback logs
its exception, and the supervisor restarts a stage that was left dead.

A stage that is alive but stuck (SIGSTOPped, a deadlocked engine, a step that never returns)
is caught by the same supervisor: while the stage holds requests, every message it sends
(Result, Progress, and the Pulse its engine loop sends as it steps) counts as progress; after
`runtime.stall_timeout_s` without any, its requests fail with StageUnavailableError (503), the
process and everything it started get SIGKILL, and it restarts like a dead one. Idle stages
send nothing and are never flagged: the clock only runs while requests are in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ..common.limits import RequestLimits
from ..common.messages import (
    Abort,
    Chunk,
    EngineMetrics,
    Inspect,
    Inspection,
    Progress,
    Pulse,
    Result,
    StageInfo,
    StreamWait,
    Submit,
    TextOutput,
)
from ..config.stage_init import StageInit
from .connector_stats import absorb_relayed
from .errors import StageConfigError, StageUnavailableError
from .handle import ReplicaStats, StageState, StageStats, limits_of, pending_stats
from .pending import PendingRequests, stall_timeout_of
from .stage_process import StageProcess

logger = logging.getLogger("vllm_omni_plugin.orchestrator")

SUPERVISE_INTERVAL_S = 0.5
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# A transient failure (a spawn hitting a resource limit, a flaky device) should not stop the
# server from coming up; a real misconfiguration still fails start-up after a few seconds.
STARTUP_ATTEMPTS = 3


class StageClient:
    def __init__(self, init: StageInit, *, startup_timeout_s: float, restart: bool = True):
        self.init = init
        self.stage_id: int = init.stage.stage_id
        self.kind: str = init.spec.kind
        self.startup_timeout_s = startup_timeout_s
        self.restart_enabled = restart
        # Every start of this stage, restarts included, begins from the environment this process
        # had when the stage was made, not from what has changed since (vLLM's CPU platform sets
        # LD_PRELOAD and thread counts as the API server builds its chat front end's config): a
        # restarted stage runs as its first start did, and is forked as it was.
        self.environ = dict(os.environ)
        self.state = StageState.STOPPED
        self.proc: StageProcess | None = None
        # Requests in flight, their progress listeners, the stall clock and the counters.
        self.pending = PendingRequests(stall_timeout_of(init.stage))
        # Live inspections awaiting the stage's answer: token -> future (see `inspect`).
        self.inspections: dict[int, asyncio.Future[Inspection]] = {}
        self._inspect_token = 0
        self.restarts = 0
        self.start_failures = 0
        self.deaths = 0
        # Stages killed for stalling, and a hook for every Pulse (a headless node relays them
        # to its head).
        self.stalls = 0
        self.on_pulse: Callable[[Pulse], None] | None = None
        self.on_wait: Callable[[StreamWait], None] | None = None  # its StreamWaits, likewise
        # An AR stage's latest vLLM metrics (EngineMetrics.families), for /metrics.
        self._engine_metrics: list = []
        self._info: StageInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._restarting: asyncio.Task | None = None

    # ---- the StageHandle face (handle.py) ------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == StageState.READY

    @property
    def load(self) -> int:
        return len(self.pending)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def stall_timeout_s(self) -> float:
        return self.pending.stall_timeout_s

    def describe(self) -> StageInfo | None:
        return self._info  # the last Ready info: kept while the stage restarts

    def limits(self) -> RequestLimits | None:
        return limits_of(self._info)

    def stats(self) -> StageStats:
        return pending_stats(self.pending, self.ready, self.restarts, self.deaths, self.stalls)

    def replica_stats(self) -> list[ReplicaStats]:
        return []

    def engine_metrics(self) -> list:
        return self._engine_metrics

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._start_until_ready(attempts=STARTUP_ATTEMPTS)
        self._spawn_task(self._supervise())

    async def _start_until_ready(self, attempts: int | None) -> None:
        """Spawn until the stage is ready (or closed): each failure is logged and retried with
        backoff; after `attempts` failures (None: never) the last one is raised."""
        backoff = FIRST_BACKOFF_S
        attempt = 0
        while self.state != StageState.CLOSED:
            attempt += 1
            try:
                await self._spawn()
                return
            except Exception as exc:
                if self.state == StageState.CLOSED:
                    return
                self.state = StageState.DEAD
                self.start_failures += 1
                # Settings the engine refused are refused again: the first start ends here.
                give_up = attempts is not None and (
                    attempt >= attempts or isinstance(exc, StageConfigError)
                )
                logger.error(
                    "start of stage %d (%s) failed (attempt %d), %s: %s",
                    self.stage_id,
                    self.kind,
                    attempt,
                    "giving up" if give_up else f"retrying in {backoff:g} s",
                    exc,
                )
                if give_up:
                    raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _spawn(self) -> None:
        assert self._loop is not None
        self.state = StageState.STARTING
        proc = StageProcess(self.init, self._on_message, self._on_exit, self.environ)
        self.proc = proc
        t0 = time.monotonic()
        # StageProcess.start kills what it started before raising.
        await self._loop.run_in_executor(None, proc.start, self.startup_timeout_s)
        if self.state == StageState.CLOSED:  # shut down while we were starting
            await self._loop.run_in_executor(None, proc.kill)
            return
        proc.start_reading(self._loop)  # replies wake this loop directly: no reader thread
        self._info = proc.info
        self.state = StageState.READY
        logger.info(
            "stage %d (%s) ready in %.1f s (pid %s)",
            self.stage_id,
            self.kind,
            time.monotonic() - t0,
            proc.pid,
        )

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        # A task's exception is otherwise only seen when someone awaits it, and nobody does.
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "stage %d (%s): background task failed",
                self.stage_id,
                self.kind,
                exc_info=task.exception(),
            )

    async def _supervise(self) -> None:
        """Backup death detection (exit codes) for when the socket gives no EOF, the stall
        watchdog, and a restart for a stage left dead (e.g. its restart task failed)."""
        while self.state != StageState.CLOSED:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            try:
                proc = self.proc
                ready = self.state == StageState.READY and proc is not None
                if ready and proc.returncode() is not None:
                    await self._on_death(proc)
                elif ready and self.pending.stalled():
                    await self._on_stall(proc, self.pending.silent_s())
                elif self.state == StageState.DEAD:
                    self._ensure_restart()
            except Exception:  # the supervisor must outlive any one bad round
                logger.exception("stage %d (%s): supervisor error", self.stage_id, self.kind)

    def shutdown(self) -> None:
        """Stop the stage (blocking, any thread). In-flight requests fail with
        StageUnavailableError at once, not after the process took its time to exit."""
        self.state = StageState.CLOSED
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._on_close)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self.proc is not None:
            self.proc.shutdown()

    def _on_close(self) -> None:
        self.pending.fail_all("the server is shutting down")
        for task in list(self._tasks):
            task.cancel()

    # ---- requests ----------------------------------------------------------------------
    async def submit(
        self,
        msg: Submit,
        on_progress: Callable[[Progress], None] | None = None,
        on_stream: Callable[[Any], None] | None = None,
    ) -> Result:
        proc = self.proc
        if self.state != StageState.READY or proc is None:
            raise StageUnavailableError(f"stage {self.stage_id} ({self.kind}) is {self.state}")
        return await self.pending.run(
            msg.request_id,
            lambda: proc.send(msg),
            self.cancel,
            f"stage {self.stage_id} ({self.kind}) is down",
            on_progress,
            on_stream,
        )

    streams = True  # streams: to other local stages directly, a final stage's to the caller

    @property
    def edge_address(self) -> str | None:
        """Where producers open streamed edges to this stage (its current process's)."""
        return self.proc.edge_address if self.proc is not None else None

    @property
    def edge_tcp_address(self) -> str | None:
        """Where producers on other nodes open streamed edges to this stage (a stage on a
        headless node; None: none can)."""
        return self.proc.edge_tcp_address if self.proc is not None else None

    def send_stream(self, msg: Any) -> None:
        """A Credit for a final stage's streamed chunk. A stage that is down drops it: its
        death fails the request anyway."""
        if self.proc is not None and self.state == StageState.READY:
            try:
                self.proc.send(msg)
            except OSError:
                pass

    def route(self, request_id: str) -> StageClient:
        return self  # one process serves every request

    def set_waiting(self, request_id: str, waiting: bool) -> None:
        self.pending.set_waiting(request_id, waiting)

    async def inspect(self, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """The stage's own view of what it holds now (Inspection, as plain data), answered by
        the loop that drives its engine; None while it is not ready or if it does not answer
        within `timeout_s` (a step longer than that, or a stuck stage)."""
        if self.state != StageState.READY or self.proc is None:
            return None
        self._inspect_token += 1
        token = self._inspect_token
        fut: asyncio.Future[Inspection] = asyncio.get_running_loop().create_future()
        self.inspections[token] = fut
        try:
            self.proc.send(Inspect(token))
            found = await asyncio.wait_for(fut, timeout_s)
        except (OSError, asyncio.TimeoutError):
            return None
        finally:
            self.inspections.pop(token, None)
        return msgspec.structs.asdict(found)

    def cancel(self, request_id: str) -> None:
        if self.proc is not None and self.state == StageState.READY:
            try:
                self.proc.send(Abort(request_id))
            except OSError:
                pass

    # ---- callbacks from the process (on this loop) --------------------------------------
    def _on_message(self, msg: Any) -> None:
        # Metrics (a timer) and inspections (answered by the stage's control loop, even while its
        # engine is stuck) are no sign of progress; everything else the stage sends is.
        if isinstance(msg, EngineMetrics):
            self._engine_metrics = msg.families
            absorb_relayed(msg.connector_stats)
            return
        if isinstance(msg, Inspection):
            waiting = self.inspections.get(msg.token)
            if waiting is not None and not waiting.done():
                waiting.set_result(msg)
            return
        self.pending.touch()
        if isinstance(msg, Pulse):
            if self.on_pulse is not None:
                self.on_pulse(msg)
        elif isinstance(msg, Result):
            self.pending.resolve(msg)
        elif isinstance(msg, (Progress, TextOutput)):  # TextOutput: a GenerateText's outputs
            self.pending.progress(msg)
        elif isinstance(msg, Chunk):
            self.pending.stream(msg)
        elif isinstance(msg, StreamWait):
            self.pending.set_waiting(msg.request_id, msg.waiting)
            if self.on_wait is not None:
                self.on_wait(msg)

    def _on_exit(self, proc: StageProcess) -> None:
        self._spawn_task(self._on_death(proc))

    async def _on_death(self, proc: StageProcess) -> None:
        # Only the current process counts: a late EOF from a replaced one is ignored.
        if self.state != StageState.READY or proc is not self.proc:
            return
        self.state = (
            StageState.DYING
        )  # not DEAD yet: no restart before the old process group is gone
        self.deaths += 1
        assert self._loop is not None
        try:
            in_flight = len(self.pending)
            code = await self._loop.run_in_executor(None, _wait_code, proc, FIRST_EXIT_WAIT_S)
            if code is None:
                # Its control socket can close well before a busy host lets the interpreter
                # finish: fail the requests now, and give the exit code (for the log) longer.
                self.pending.fail_all(f"stage {self.stage_id} ({self.kind}) died")
                code = await self._loop.run_in_executor(None, _wait_code, proc, EXIT_WAIT_S)
            logger.error(
                "stage %d (%s) died with exit code %s; failing %d in-flight request(s)%s",
                self.stage_id,
                self.kind,
                code,
                in_flight,
                ", restarting" if self.restart_enabled else "",
            )
            self.pending.fail_all(f"stage {self.stage_id} ({self.kind}) died (exit code {code})")
            await self._loop.run_in_executor(None, proc.kill)
        finally:  # whatever failed above, the stage must not stay "dying" for good
            if self.state == StageState.DYING:
                self.state = StageState.DEAD
            self._ensure_restart()

    async def _on_stall(self, proc: StageProcess, silent: float) -> None:
        """The stage holds requests but reported no progress for `silent` s: fail them, kill
        it (SIGKILL at once: a stopped or deadlocked process acts on nothing gentler) and let
        the restart path bring up a fresh one. /health is unhealthy until it is ready."""
        if self.state != StageState.READY or proc is not self.proc:
            return
        self.state = StageState.DYING
        self.stalls += 1
        assert self._loop is not None
        try:
            logger.error(
                "stage %d (%s, pid %s) made no progress for %.1f s with %d request(s) in "
                "flight (stall_timeout_s %g); failing them, killing it%s",
                self.stage_id,
                self.kind,
                proc.pid,
                silent,
                len(self.pending),
                self.stall_timeout_s,
                " and restarting" if self.restart_enabled else "",
            )
            self.pending.fail_all(
                f"stage {self.stage_id} ({self.kind}) made no progress for {silent:.0f} s "
                f"(stall_timeout_s {self.stall_timeout_s:g}); it is being restarted"
            )
            await self._loop.run_in_executor(None, proc.kill_now)
        finally:
            if self.state == StageState.DYING:
                self.state = StageState.DEAD
            self._ensure_restart()

    def _ensure_restart(self) -> None:
        """Start the restart task unless one is running (one restart loop per stage)."""
        if not self.restart_enabled or self.state in (StageState.CLOSED, StageState.READY):
            return
        if self._restarting is None or self._restarting.done():
            self._restarting = self._spawn_task(self._restart())

    async def _restart(self) -> None:
        await self._start_until_ready(attempts=None)
        if self.state == StageState.READY:
            self.restarts += 1


# How long a dead stage's process gets to finish exiting: first with its requests still
# waiting (their 503 then names the exit code), then after they failed, before it is killed
# (its exit code then reads None in the log).
FIRST_EXIT_WAIT_S = 2.0
EXIT_WAIT_S = 10.0


def _wait_code(proc: StageProcess, timeout_s: float) -> int | None:
    assert proc.proc is not None
    try:
        return proc.proc.wait(timeout_s)
    except Exception:
        return proc.returncode()
