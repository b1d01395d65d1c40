"""Errors the orchestrator raises; the HTTP layer maps them to OpenAI-shaped responses."""

from __future__ import annotations


class StageStartupError(RuntimeError):
    """A stage did not become ready; the message names the stage and shows its log tail."""


class StageConfigError(StageStartupError):
    """A stage's engine refused its settings (vLLM's config validation): another start with the
    same settings would be refused too, so the first start is not retried."""


class StageUnavailableError(RuntimeError):
    """A stage the request needs is down or restarting (HTTP 503)."""


class StageRequestError(RuntimeError):
    """A stage rejected or failed one request. `field` is set for validation errors (400)."""

    def __init__(self, stage_id: int, message: str, field: str | None = None):
        super().__init__(f"stage {stage_id}: {message}")
        self.stage_id = stage_id
        self.message = message
        self.field = field
