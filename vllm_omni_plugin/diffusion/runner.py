"""Runs a scheduled batch on the model adapter: prepare, one denoising step, decode.

With a side lane (side_lane.py, `overlap_encode_decode`), the prepare of requests admitted to it
and the decode of requests whose last step ran are handed to the lane instead of run here.

A failure in a phase fails the requests of that phase, never the engine, except a device error
(phase_guard.py).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from .adapters.base import DiffusionAdapter
from .errors import DeviceError
from .phase_guard import is_device_error, run_guarded
from .phase_log import ENGINE_LANE, PhaseLog
from .request import RequestState
from .scheduler import RunnerOutput, ScheduledBatch

if TYPE_CHECKING:
    from .side_lane import SideLane

__all__ = ["FAULT_PROMPT_ENV", "ModelRunner", "injected_device_error", "is_device_error"]

logger = logging.getLogger(__name__)

# Test-only fault injection, inert unless set: a request whose prompt equals this variable's
# value makes its denoising step (or whole-pipeline run) raise a real device error
# (torch.AcceleratorError where torch has it), so a CPU test can show that a device error takes
# the stage down. Read once per engine; never set it in production.
FAULT_PROMPT_ENV = "VLLM_OMNI_TEST_DEVICE_ERROR_PROMPT"


def injected_device_error() -> RuntimeError:
    cls = getattr(torch, "AcceleratorError", RuntimeError)
    return cls(
        f"CUDA error: an illegal memory access was encountered (injected: {FAULT_PROMPT_ENV})"
    )


class ModelRunner:
    def __init__(
        self,
        adapter: DiffusionAdapter,
        side_lane: SideLane | None = None,
        log: PhaseLog | None = None,
    ) -> None:
        self.adapter = adapter
        self.side_lane = side_lane
        self.log = log or PhaseLog()
        self._fault_prompt = os.environ.get(FAULT_PROMPT_ENV) or None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        out = RunnerOutput()
        if batch.whole is not None:
            self._run_whole(batch.whole, out)
            return out
        if batch.prefill:
            with self._turn():
                self._prepare(batch.prefill, out)
        if batch.prepare_aside:
            self.side_lane.prepare(batch.prepare_aside)
        group = [s for s in batch.denoise if s.request_id not in out.failed]
        if group:
            with self.log.span("denoise", ENGINE_LANE, group):
                self._guard(group, out, "denoise", self.adapter.denoise)
        # Streaming previews: requests whose step just run is one of their preview steps.
        want = [s for s in group if s.x0 is not None and s.request_id not in out.failed]
        if want:
            with self._turn():
                self._preview(want, out)
        # A request that just took its last step is decoded with its group: on the side lane
        # when there is one (after this step's queued work), else now.
        last = [s for s in group if s.request_id not in out.failed and s.step + 1 >= s.total_steps]
        if last and self.side_lane is not None:
            self.side_lane.decode(last)
            out.decoding.update(s.request_id for s in last)
        elif last:
            self._decode(last, out)
        return out

    def _turn(self):
        """The side lane's lock around engine-thread calls into modules its phases use."""
        return nullcontext() if self.side_lane is None else self.side_lane.turn()

    def _prepare(self, states: list[RequestState], out: RunnerOutput) -> None:
        t0 = time.perf_counter()
        with self.log.span("prepare", ENGINE_LANE, states):
            self._guard(states, out, "prepare", self.adapter.prepare)
        for s in states:
            s.prepare_s = time.perf_counter() - t0

    def _decode(self, states: list[RequestState], out: RunnerOutput) -> None:
        t0 = time.perf_counter()
        with self.log.span("decode", ENGINE_LANE, states):
            images = self._guard(states, out, "decode", self.adapter.decode)
        for s in states:  # the images are on the host now: the decode has finished
            s.decode_s = time.perf_counter() - t0
        if images is not None:
            for s, imgs in zip(states, images, strict=True):
                out.finished[s.request_id] = imgs
                s.latents = None
                s.cond.clear()

    def _preview(self, states: list[RequestState], out: RunnerOutput) -> None:
        """Decode the x0 previews in one VAE call. A failed preview is skipped (logged), never
        the request's failure; a device error still takes the engine down."""
        t0 = time.perf_counter()
        try:
            with self.log.span("preview", ENGINE_LANE, states):
                images = self.adapter.preview(states)
        except Exception as exc:
            if is_device_error(exc):
                raise DeviceError(f"preview decode: {type(exc).__name__}: {exc}") from exc
            logger.exception("preview decode failed for %s", [s.request_id for s in states])
            for s in states:
                s.x0 = None
            return
        spent = time.perf_counter() - t0
        for s, imgs in zip(states, images, strict=True):
            s.preview_s += spent
            out.previews[s.request_id] = (s.preview_at.index(s.step), imgs)

    def _guard(self, states: list[RequestState], out: RunnerOutput, phase: str, fn):
        """Run one phase; a failure fails these requests, a device error the engine."""

        def run(states: list[RequestState]):
            self._maybe_inject_fault(states, phase)
            return fn(states)

        return run_guarded(states, out, phase, run)

    def _maybe_inject_fault(self, states: list[RequestState], phase: str) -> None:
        if self._fault_prompt is None or phase not in ("denoise", "pipeline"):
            return
        if any(s.req.prompt == self._fault_prompt for s in states):
            raise injected_device_error()

    def _run_whole(self, state: RequestState, out: RunnerOutput) -> None:
        def on_step(i: int) -> None:
            state.step = i

        images = self._guard(
            [state], out, "pipeline", lambda states: self.adapter.generate(states[0], on_step)
        )
        if images is not None:
            out.finished[state.request_id] = images
