"""The request bounds a diffusion engine enforces, computed once and announced to the API server.

The engine validates every request against these; the stage sends the same object in its Ready
message and serving checks requests against it before they travel. No other layer repeats the
arithmetic (granularity, size bounds, seed range). Plain Python: no torch, no vLLM.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

MAX_SEED = 2**63 - 1
"""Largest seed accepted: torch.Generator.manual_seed takes a signed 64-bit value."""


@dataclass(frozen=True)
class RequestLimits:
    """What one diffusion stage accepts; height/width bounds are per dimension."""

    granularity: int
    min_height: int
    min_width: int
    max_height: int
    max_width: int
    max_steps: int
    max_batch_size: int
    default_height: int
    default_width: int
    max_seed: int = MAX_SEED

    @property
    def min_size(self) -> int:
        return max(self.min_height, self.min_width)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (the JSON of GET /v1/omni/stages)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestLimits:
        """The inverse of `to_dict`; a missing or unknown field is an error, not a default."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown request limit(s) {sorted(unknown)}")
        return cls(**{k: int(v) for k, v in data.items()})


def size_granularity(family: int, configured: int | None) -> int:
    """Height and width must be multiples of both the family's and the configured granularity."""
    return math.lcm(family, configured) if configured else family


# Streaming previews a request may ask for (OpenAI's `partial_images` bound).
MAX_PARTIAL_IMAGES = 3
