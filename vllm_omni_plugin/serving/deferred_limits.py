"""Request limits when the final stage runs on a node that has not registered yet.

The limits come from the final stage's Ready info (what its engine applied). A multi-node head
serves before its nodes register, so until the first registration every request is answered
503 (the stage is missing) instead of the head failing to start; afterwards the limits are
computed once and kept, also while the node restarts.
"""

from __future__ import annotations

from typing import Any

from .errors import unavailable
from .handlers import limits_from
from .protocol import ImageLimits


class DeferredLimits:
    """Stands in for ImageLimits: attribute reads raise 503 until the final stage is known."""

    def __init__(self, orchestrator: Any, serving: Any):
        self._orchestrator = orchestrator
        self._serving = serving
        self._limits: ImageLimits | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._limits is None:
            if self._orchestrator.final_limits() is None:
                raise unavailable(
                    f"stage(s) {self._orchestrator.unhealthy_stages()} have no live node yet; "
                    "retry once the node has registered"
                )
            self._limits = limits_from(self._orchestrator, self._serving)
        return getattr(self._limits, name)


def limits_or_deferred(orchestrator: Any, serving: Any) -> ImageLimits | DeferredLimits:
    if orchestrator.final_limits() is not None:
        return limits_from(orchestrator, serving)
    return DeferredLimits(orchestrator, serving)
