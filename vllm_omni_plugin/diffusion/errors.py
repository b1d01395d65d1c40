"""Typed errors of the diffusion engine.

Request validation errors (common/errors.py: every stage kind raises them, the API server maps
them to a 400 naming the field) are raised before anything reaches the model.
"""

from __future__ import annotations

from ..common.errors import CapacityError, RequestValidationError

__all__ = [
    "CapacityError",
    "DeviceError",
    "DiffusionEngineError",
    "RequestValidationError",
    "UnsupportedModelError",
]


class DiffusionEngineError(RuntimeError):
    """An engine-side failure (model load, unsupported checkpoint, internal error)."""


class DeviceError(DiffusionEngineError):
    """The accelerator failed (a CUDA error): the device context is unusable for every later
    request, so the engine must not go on as if only one batch had failed."""


class UnsupportedModelError(DiffusionEngineError):
    """The checkpoint's pipeline class has no adapter and cannot run through the fallback."""
