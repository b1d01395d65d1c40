"""Runs a scheduled batch on the model adapter: prepare, one denoising step, decode.

A failure in a phase fails the requests of that phase, never the engine, except a device error
(a CUDA error): after one the device context is unusable, so it is raised as DeviceError and
takes the stage down (the stage process exits and is restarted) instead of leaving a broken
engine that reports ready.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from .adapters.base import DiffusionAdapter
from .errors import DeviceError
from .request import RequestState
from .scheduler import RunnerOutput, ScheduledBatch

logger = logging.getLogger(__name__)

# Test-only fault injection, inert unless set: a request whose prompt equals this variable's
# value makes its denoising step (or whole-pipeline run) raise a real device error
# (torch.AcceleratorError where torch has it), so a CPU test can show that a device error takes
# the stage down. Read once per engine; never set it in production.
FAULT_PROMPT_ENV = "VLLM_OMNI_TEST_DEVICE_ERROR_PROMPT"

# Messages of RuntimeErrors that come from a failed device, not from a bad input. "CUDA out of
# memory" is not among them: an OOM fails the batch, the device stays usable.
_DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "CUDA driver error",
    "CUBLAS_STATUS_",
    "cuDNN error",
    "device-side assert triggered",
)


def is_device_error(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, getattr(torch.cuda, "CudaError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_ERROR_MARKERS)


def injected_device_error() -> RuntimeError:
    cls = getattr(torch, "AcceleratorError", RuntimeError)
    return cls(
        f"CUDA error: an illegal memory access was encountered (injected: {FAULT_PROMPT_ENV})"
    )


class ModelRunner:
    def __init__(self, adapter: DiffusionAdapter) -> None:
        self.adapter = adapter
        self._fault_prompt = os.environ.get(FAULT_PROMPT_ENV) or None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        out = RunnerOutput()
        if batch.whole is not None:
            self._run_whole(batch.whole, out)
            return out
        if batch.prefill:
            self._guard(batch.prefill, out, "prepare", self.adapter.prepare)
        group = [s for s in batch.denoise if s.request_id not in out.failed]
        if group:
            self._guard(group, out, "denoise", self.adapter.denoise)
        # Streaming previews: requests whose step just run is one of their preview steps.
        want = [s for s in group if s.x0 is not None and s.request_id not in out.failed]
        if want:
            self._preview(want, out)
        # A request that just took its last step is decoded now, together with its group.
        last = [s for s in group if s.request_id not in out.failed and s.step + 1 >= s.total_steps]
        if last:
            t0 = time.perf_counter()
            images = self._guard(last, out, "decode", self.adapter.decode)
            for s in last:  # the images are on the host now: the decode has finished
                s.decode_s = time.perf_counter() - t0
            if images is not None:
                for s, imgs in zip(last, images, strict=True):
                    out.finished[s.request_id] = imgs
                    s.latents = None
                    s.cond.clear()
        return out

    def _preview(self, states: list[RequestState], out: RunnerOutput) -> None:
        """Decode the x0 previews in one VAE call. A failed preview is skipped (logged), never
        the request's failure; a device error still takes the engine down."""
        t0 = time.perf_counter()
        try:
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
        try:
            self._maybe_inject_fault(states, phase)
            return fn(states)
        except Exception as exc:
            ids = [s.request_id for s in states]
            if is_device_error(exc):
                raise DeviceError(
                    f"diffusion {phase} of {ids}: {type(exc).__name__}: {exc}"
                ) from exc
            logger.exception("diffusion %s failed for %s", phase, ids)
            for s in states:
                out.failed[s.request_id] = f"{phase} failed: {type(exc).__name__}: {exc}"
            return None

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
