"""What the engine hands back for each finished (or failed) request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image


@dataclass
class GenerationOutput:
    request_id: str
    images: list[Image.Image]
    error: str | None = None
    # Timings and facts about the run: queue_s, total_s, steps, seed, batch sizes seen.
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None
