"""Request and response models of POST /v1/images/generations (OpenAI's shape + our extras)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from vllm_omni_plugin.common.limits import RequestLimits

# "file": the image bytes themselves (n > 1: a zip of them), as vLLM-Omni's servers answer.
ResponseFormat = Literal["b64_json", "url", "file"]
OutputFormat = Literal["png", "jpeg", "webp"]


class ImageGenerationRequest(BaseModel):
    """OpenAI's fields plus the diffusion fields every family takes. Strict types: "3" is not an
    int, 1.5 is not a seed. Any other field is refused (serving/request_fields.py decides
    before this model sees the body: a family's own knobs are checked there)."""

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr
    model: StrictStr | None = None
    n: StrictInt = 1
    size: StrictStr | None = None
    response_format: ResponseFormat = "b64_json"
    output_format: OutputFormat = "png"
    output_compression: StrictInt | None = Field(default=None, ge=0, le=100)
    # Your end user's id (OpenAI's field): logged with the request id.
    user: StrictStr | None = None
    # OpenAI's choices for its own models, taken where they describe what we do: "auto" (the
    # server's choice: echoed in stream events), and opaque backgrounds (ours always are).
    quality: Literal["auto"] | None = None
    background: Literal["auto", "opaque"] | None = None
    moderation: Literal["auto"] | None = None
    # Streaming (SSE): OpenAI's image_generation.partial_image / .completed events.
    stream: StrictBool | None = None
    partial_images: StrictInt | None = None
    # Extras (diffusers' names).
    seed: StrictInt | None = None
    num_inference_steps: StrictInt | None = None
    guidance_scale: StrictFloat | StrictInt | None = None
    negative_prompt: StrictStr | None = None
    # Vendor extension: stream progress as `event: omni.progress` SSE events (for browser
    # EventSource UIs) instead of SSE comments (which every SSE client, the openai one too,
    # skips).
    progress_events: StrictBool | None = None
    # Step caching, per request: {"policy": "first_block", "threshold": 0.1} (cache_policy.py);
    # the stage refuses a policy it does not enable.
    cache: dict[str, Any] | None = None


@dataclass(frozen=True)
class ImageLimits:
    """Bounds one deployment accepts: the final stage's own limits (as its engine announced them
    at start-up) plus the pipeline-wide `serving:` text and `n` bounds."""

    stage: RequestLimits
    max_n: int
    max_prompt_chars: int
    max_negative_prompt_chars: int
    # The served family's knobs and unapplied fields (request_fields.FamilyFields; None: none).
    family: Any = None

    @classmethod
    def build(cls, stage: RequestLimits, serving: Any, family: Any = None) -> ImageLimits:
        """`serving` is the config's ServingLimits (None: its defaults)."""
        if serving is None:
            from vllm_omni_plugin.config.owners_common import ServingLimits

            serving = ServingLimits()
        return cls(
            stage=stage,
            # One request's images are denoised together, so n is capped by the batch too.
            max_n=min(serving.max_n, stage.max_batch_size),
            max_prompt_chars=serving.max_prompt_chars,
            max_negative_prompt_chars=serving.max_negative_prompt_chars,
            family=family,
        )


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
    stream: bool = False
    partial_images: int = 0
    progress_events: bool = False
    # Step caching: the request's checked `cache` (cache_policy.CachePolicy.as_dict()), or None.
    cache: dict[str, Any] | None = None
    # Echoed in stream events (OpenAI's fields; they change nothing here).
    quality: str = "auto"
    background: str = "auto"
    # Edits (POST /v1/images/edits, serving/edits.py): the checked source images and mask in
    # the stages' form (GenerationParams.input_images / mask), and the stream's event names.
    input_images: tuple[bytes, ...] = ()
    mask: bytes | None = None
    event_prefix: str = "image_generation"
    # The family's knobs this request sets (GenerationParams.knobs) and route-wide extension
    # fields (request_fields.EXTENSIONS), each checked.
    knobs: dict[str, Any] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)
    user: str | None = None
