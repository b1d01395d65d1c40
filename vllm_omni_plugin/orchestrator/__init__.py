"""The stage graph at run time: start stages, route requests, health, restart, shutdown."""

from .errors import StageRequestError, StageStartupError, StageUnavailableError
from .orchestrator import Orchestrator, PipelineResult

__all__ = [
    "Orchestrator",
    "PipelineResult",
    "StageRequestError",
    "StageStartupError",
    "StageUnavailableError",
]
