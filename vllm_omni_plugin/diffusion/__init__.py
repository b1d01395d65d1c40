"""Step-batched diffusion engine on diffusers components. Imports without vLLM."""

from .config import DiffusionEngineConfig
from .engine import DiffusionEngine
from .errors import (
    CapacityError,
    DiffusionEngineError,
    RequestValidationError,
    UnsupportedModelError,
)
from .outputs import GenerationOutput
from .request import GenerationRequest

__all__ = [
    "CapacityError",
    "DiffusionEngine",
    "DiffusionEngineConfig",
    "DiffusionEngineError",
    "GenerationOutput",
    "GenerationRequest",
    "RequestValidationError",
    "UnsupportedModelError",
]
