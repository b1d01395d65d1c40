"""One phase of a batch, guarded: a failure fails the requests of that phase, never the engine,
except a device error (a CUDA error): after one the device context is unusable, so it is raised
as DeviceError and takes the stage down (the stage process exits and is restarted) instead of
leaving a broken engine that reports ready. The engine thread and the side lane both run their
phases through `run_guarded`.
"""

from __future__ import annotations

import logging

import torch

from .errors import DeviceError
from .request import RequestState
from .scheduler import RunnerOutput

logger = logging.getLogger(__name__)

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


def run_guarded(states: list[RequestState], out: RunnerOutput, phase: str, fn):
    """Run one phase; a failure fails these requests (`out.failed`), a device error the engine
    (raised as DeviceError)."""
    try:
        return fn(states)
    except Exception as exc:
        ids = [s.request_id for s in states]
        if is_device_error(exc):
            raise DeviceError(f"diffusion {phase} of {ids}: {type(exc).__name__}: {exc}") from exc
        logger.exception("diffusion %s failed for %s", phase, ids)
        for s in states:
            out.failed[s.request_id] = f"{phase} failed: {type(exc).__name__}: {exc}"
        return None
