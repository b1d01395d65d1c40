"""Runs a scheduled batch on the model adapter: prepare, one denoising step, decode."""

from __future__ import annotations

import logging

import torch

from .adapters.base import DiffusionAdapter
from .request import RequestState
from .scheduler import RunnerOutput, ScheduledBatch

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, adapter: DiffusionAdapter) -> None:
        self.adapter = adapter

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
        # A request that just took its last step is decoded now, together with its group.
        last = [s for s in group if s.request_id not in out.failed and s.step + 1 >= s.total_steps]
        if last:
            images = self._guard(last, out, "decode", self.adapter.decode)
            if images is not None:
                for s, imgs in zip(last, images, strict=True):
                    out.finished[s.request_id] = imgs
                    s.latents = None
                    s.cond.clear()
        return out

    def _guard(self, states: list[RequestState], out: RunnerOutput, phase: str, fn):
        """Run one phase; a failure fails these requests, never the engine."""
        try:
            return fn(states)
        except Exception as exc:
            logger.exception("diffusion %s failed for %s", phase, [s.request_id for s in states])
            for s in states:
                out.failed[s.request_id] = f"{phase} failed: {type(exc).__name__}: {exc}"
            return None

    def _run_whole(self, state: RequestState, out: RunnerOutput) -> None:
        def on_step(i: int) -> None:
            state.step = i

        try:
            out.finished[state.request_id] = self.adapter.generate(state, on_step)
        except Exception as exc:
            logger.exception("diffusion pipeline failed for %s", state.request_id)
            out.failed[state.request_id] = f"pipeline failed: {type(exc).__name__}: {exc}"
