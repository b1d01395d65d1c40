"""The side lane: prepare and decode of requests on a worker thread, beside the denoising.

Without it every phase runs on the engine thread in turn, so a newly admitted request's text
encoding and a finished request's VAE decode stall every other running request's next step.
With it (`overlap_encode_decode`), the engine thread hands those two phases to one worker
thread (on CUDA with its own stream) and goes on stepping the other requests:

  * a request admitted by the scheduler is prepared here and joins the denoising groups once its
    preparation is complete (the scheduler collects it at the start of a step);
  * a request whose last step ran is decoded here and emitted by the step that collects it.

One worker and one job per handoff: jobs run in the order they were handed over. The lane is
bounded by the scheduler, which counts requests here as admitted (`max_batch_size`, the memory
budget) until their result is collected, aborted ones included: at most `capacity` jobs.

A failed phase fails its requests, as on the engine thread; a device error is kept and raised
as DeviceError by `collect()`, on the engine thread.

The engine thread still runs some work that shares modules with the lane's phases: streaming
previews (the VAE, whose video variants keep per-call caches on the module) and prepares that
cannot run here (`DiffusionAdapter.prepares_aside`), which set timesteps on the pipeline's one
scheduler as the lane's prepares do. Those calls take `turn()`, the lock each job holds, so
the two threads never run them at once; the denoising itself never takes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from .adapters.base import DiffusionAdapter
from .errors import DeviceError, DiffusionEngineError
from .phase_guard import is_device_error, run_guarded
from .phase_log import SIDE_LANE, PhaseLog
from .request import RequestState, RequestStatus
from .scheduler import RunnerOutput, SideResult
from .stream_handoff import StreamHandoff

logger = logging.getLogger(__name__)

PREPARE = "prepare"
DECODE = "decode"
# How long `close()` waits for the job in progress before leaving the (daemon) thread behind.
CLOSE_TIMEOUT_S = 60.0


@dataclass
class SideJob:
    phase: str  # PREPARE | DECODE
    states: list[RequestState]
    after: Any = None  # CUDA decode: the event after the last denoising step
    hand_to: Any = None  # CUDA prepare: the engine's stream, which reads what prepare makes


class SideLane:
    def __init__(
        self, adapter: DiffusionAdapter, device: torch.device, capacity: int, log: PhaseLog
    ) -> None:
        self.adapter = adapter  # its `prepare` and `decode` run here
        self.capacity = capacity
        self.log = log
        self.streams = StreamHandoff(device)
        self._cond = threading.Condition()
        self._jobs: deque[SideJob] = deque()
        self._done: list[SideResult] = []
        self._in_flight = 0  # jobs handed over whose results are not collected yet
        self._closed = False
        self._turn = threading.Lock()
        # A daemon: an engine never closed does not keep its process alive.
        self._thread = threading.Thread(target=self._work, name="diffusion-side-lane", daemon=True)
        self._thread.start()

    # ---- the engine thread --------------------------------------------------------------------
    def prepare(self, states: list[RequestState]) -> None:
        self._submit(SideJob(PREPARE, list(states), hand_to=self.streams.engine_stream()))

    def decode(self, states: list[RequestState]) -> None:
        """Hand over requests whose last denoising step was just queued on the engine's stream."""
        self.streams.hand_over(states, self.streams.side)
        self._submit(SideJob(DECODE, list(states), after=self.streams.engine_mark()))

    def collect(self) -> list[SideResult]:
        """The results finished since the last call, without waiting. The engine's stream waits
        for what prepare made before anything it queues next; a device error raises here."""
        with self._cond:
            done, self._done = self._done, []
            self._in_flight -= len(done)
        for result in done:
            if result.device_error is not None:
                raise result.device_error
            self.streams.engine_waits(result.ready)
        return done

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._in_flight > 0

    def wait(self, timeout_s: float) -> None:
        """Block until a result is ready to collect, at most `timeout_s`."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._closed, timeout_s)

    def turn(self) -> threading.Lock:
        """Held by each job; the engine thread takes it around its own calls into the modules
        the lane's phases use (see the module docstring)."""
        return self._turn

    def close(self) -> None:
        """Drop the jobs not started, let the one in progress end, stop the worker."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("side lane still busy after %.0f s; left behind", CLOSE_TIMEOUT_S)

    def _submit(self, job: SideJob) -> None:
        with self._cond:
            if self._closed:
                raise DiffusionEngineError("the engine is closed")
            if self._in_flight >= self.capacity:
                # The scheduler admits at most `capacity` requests, each of these jobs holds one.
                raise DiffusionEngineError(f"side lane over its bound of {self.capacity} jobs")
            self._jobs.append(job)
            self._in_flight += 1
            self._cond.notify_all()

    # ---- the worker thread --------------------------------------------------------------------
    def _work(self) -> None:
        self.streams.enter_side_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if self._closed:
                    return
                job = self._jobs.popleft()
            result = self._run(job)
            with self._cond:
                self._done.append(result)
                self._cond.notify_all()

    @torch.inference_mode()  # grad mode is per thread: the engine thread's does not reach here
    def _run(self, job: SideJob) -> SideResult:
        result = SideResult(job.phase, job.states)
        if all(s.status is RequestStatus.FINISHED for s in job.states):
            return result  # all aborted before their turn: nothing to do
        out = RunnerOutput()
        value = None
        start = time.perf_counter()
        try:
            with (
                self._turn,
                self.streams.on_side(),
                self.log.span(job.phase, SIDE_LANE, job.states),
            ):
                start = time.perf_counter()  # its own time, not the wait for its turn
                self.streams.side_waits(job.after)
                value = run_guarded(job.states, out, job.phase, getattr(self.adapter, job.phase))
                if job.phase == PREPARE:
                    self.streams.hand_over(job.states, job.hand_to)
                result.ready = self.streams.side_done()
        except DeviceError as exc:
            result.device_error = exc
            return result
        except Exception as exc:  # around the phase (its stream, its event): as in the phase
            ids = [s.request_id for s in job.states]
            message = f"{job.phase} failed: {type(exc).__name__}: {exc}"
            if is_device_error(exc):
                result.device_error = DeviceError(f"diffusion {job.phase} of {ids}: {message}")
                return result
            logger.exception("side lane %s failed for %s", job.phase, ids)
            out.failed.update(dict.fromkeys(ids, message))
        spent = time.perf_counter() - start
        result.failed = out.failed
        for s in job.states:
            setattr(s, f"{job.phase}_s", spent)  # prepare_s / decode_s of the request's metrics
        if job.phase == DECODE and value is not None and not out.failed:
            for s, images in zip(job.states, value, strict=True):
                result.images[s.request_id] = images
                s.latents = None  # decoded: the latents and conditioning are no longer needed
                s.cond.clear()
        return result
