"""Typed errors of the diffusion engine.

Validation errors carry the offending field so the HTTP layer can answer a 400 that names it,
and are raised before anything reaches the model.
"""

from __future__ import annotations


class DiffusionEngineError(RuntimeError):
    """An engine-side failure (model load, unsupported checkpoint, internal error)."""


class DeviceError(DiffusionEngineError):
    """The accelerator failed (a CUDA error): the device context is unusable for every later
    request, so the engine must not go on as if only one batch had failed."""


class UnsupportedModelError(DiffusionEngineError):
    """The checkpoint's pipeline class has no adapter and cannot run through the fallback."""


class RequestValidationError(ValueError):
    """A request parameter is invalid; `field` names it (e.g. "height", "num_inference_steps")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CapacityError(RequestValidationError):
    """The request can never fit the engine's limits (max batch size or memory budget)."""
