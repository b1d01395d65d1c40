"""Request and response models of POST /v1/images/generations (OpenAI's shape + our extras)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

ResponseFormat = Literal["b64_json", "url"]
OutputFormat = Literal["png", "jpeg", "webp"]


class ImageGenerationRequest(BaseModel):
    """OpenAI's fields plus diffusion knobs. Strict types: "3" is not an int, 1.5 is not a seed.

    Unknown OpenAI fields (quality, style, background, ...) are accepted and ignored so the
    official client keeps working; they never reach a stage.
    """

    model_config = ConfigDict(extra="ignore")

    prompt: StrictStr
    model: StrictStr | None = None
    n: StrictInt = 1
    size: StrictStr | None = None
    response_format: ResponseFormat = "b64_json"
    output_format: OutputFormat = "png"
    output_compression: StrictInt | None = Field(default=None, ge=0, le=100)
    user: StrictStr | None = None
    # Extras (diffusers' names).
    seed: StrictInt | None = None
    num_inference_steps: StrictInt | None = None
    guidance_scale: StrictFloat | StrictInt | None = None
    negative_prompt: StrictStr | None = None


@dataclass(frozen=True)
class ImageLimits:
    """Bounds one deployment accepts; filled from the stage config (see serving/limits.py)."""

    max_n: int
    max_prompt_chars: int
    min_size: int
    max_width: int
    max_height: int
    granularity: int
    max_steps: int
    default_width: int
    default_height: int


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed every check, ready for the orchestrator."""

    prompt: str
    n: int
    width: int
    height: int
    response_format: str
    output_format: str
    output_compression: int | None
    seed: int | None
    num_inference_steps: int | None
    guidance_scale: float | None
    negative_prompt: str | None
