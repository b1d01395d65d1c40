"""A generation request as users send it, and the engine's per-request state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GenerationRequest:
    request_id: str
    prompt: str
    negative_prompt: str | None = None
    n: int = 1
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    # GLM-Image only: [n or 1, L] prior token ids, exactly what
    # GlmImagePipeline.generate_prior_tokens returns (the AR stage's output).
    prior_token_ids: torch.LongTensor | None = None
    # Streaming: decode this many previews (0..MAX_PARTIAL_IMAGES) of the current x0 prediction
    # at evenly spaced denoising steps (`preview_steps`).
    partial_images: int = 0
    # Video families (Wan): frames of the one video (None: the family's or stage's default).
    num_frames: int | None = None
    # Edits: the source images (PIL RGB, decoded from the API server's lossless PNGs) and the
    # inpainting mask (PIL "L", 255 = repaint); only for adapters that declare them.
    input_images: list[Any] = field(default_factory=list)
    mask: Any = None
    # The family's own knobs set by this request (adapter.knobs: name -> checked value).
    knobs: dict[str, Any] = field(default_factory=dict)
    # Step caching: {"policy": "first_block", "threshold": 0.1} as the user sent it (None: the
    # stage's default); `DiffusionEngine.validate` turns it into a checked CachePolicy.
    cache: Any = None
    # LoRA adapters: [{"name": ..., "scale": ..., "path": folder under lora.dir (default: the
    # name)}] as the API server sent them; `DiffusionEngine.validate` turns them into checked
    # adapters (lora/store.py CheckedLora).
    lora: Any = None


def preview_steps(total_steps: int, partial_images: int) -> tuple[int, ...]:
    """0-based indices of the steps after which a preview is decoded: `partial_images` of them
    (fewer when there are not enough steps), evenly spaced, never the last step (the final image
    follows it). 10 steps, 2 previews: after steps 3 and 6 (indices 2, 5)."""
    n = max(0, min(partial_images, total_steps - 1))
    return tuple((i + 1) * total_steps // (n + 1) - 1 for i in range(n))


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: states live in queues and sets
class RequestState:
    """Everything the engine keeps for one request between steps.

    The adapter fills `latents`, `timesteps`, `sigmas` and `cond` in `prepare`; the scheduler
    owns `step`. Each request has its own schedule, so requests at different steps (or with
    different step counts) can share one transformer forward.
    """

    req: GenerationRequest  # validated: every optional field is filled
    seed: int
    do_cfg: bool
    arrival: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    step: int = 0
    generator: torch.Generator | None = None
    latents: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    sigmas: torch.Tensor | None = None
    # Family-specific conditioning (prompt embeddings, masks, prior ids, ...).
    cond: dict[str, Any] = field(default_factory=dict)
    started: float | None = None
    batch_sizes: list[int] = field(default_factory=list)
    prepare_s: float = 0.0  # its prepare (text encoding, latents), batched with its admission
    decode_s: float = 0.0  # VAE decode of its batch (x-omni-stage-timings)
    # Streaming previews: step indices to preview after (`preview_steps`); `x0` holds the
    # x0 prediction of the step just run when that step is one of them, until decoded.
    preview_at: tuple[int, ...] = ()
    x0: torch.Tensor | None = None
    preview_s: float = 0.0  # time spent decoding its previews
    # Its step-cache state (step_cache/state.py RequestCache); None: every step computed.
    step_cache: Any = None
    # Its LoRA adapters while it runs: (resident adapter, scale) pairs pinned at admission.
    lora: list[tuple[Any, float]] = field(default_factory=list)
    lora_error: str | None = None  # its adapters could not be loaded at admission

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def total_steps(self) -> int:
        assert self.req.num_inference_steps is not None
        return self.req.num_inference_steps

    @property
    def n(self) -> int:
        return self.req.n

    @property
    def rows(self) -> int:
        """Transformer batch rows this request occupies per step (CFG doubles them)."""
        return self.req.n * (2 if self.do_cfg else 1)
