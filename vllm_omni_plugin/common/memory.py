"""What one diffusion request needs in memory, and whether it fits: the engine's admission rule,
announced by the stage so the API server refuses with the same arithmetic before a job exists.

A request's bytes are an estimate (documented terms, not a measurement):

- the transformer forward, per row (CFG doubles the rows, `n` multiplies them): its sequence is
  the latent tokens of every output frame, the text tokens, and the tokens each source image
  adds (edits put the image's latents, and for some families its vision tokens, in the
  sequence; every step computes their K and V); linear in tokens x width for the projections and
  MLP, plus, where attention materialises its scores (math SDPA: CPU stages, or
  `attention_backend: math`), quadratic in tokens;
- the VAE decode of the output at the chosen resolution: the frames it decodes at once (video
  VAEs decode a latent frame, `frame_step` frames, at a time) and the float32 pixels of every
  frame;
- the VAE encode of the source images, the same way (Wan2.2 I2V-A14B encodes a whole video of
  the output's frames: the image followed by black frames).

Plain Python: no torch, no vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Activation elements per token and width unit of one transformer row (projections, MLP,
# residuals, norms alive at the peak), and per attention score.
LINEAR_FACTOR = 24
SCORE_FACTOR = 2
# VAE bytes per pixel of a frame it works on: 128 float32 channels, three buffers; and of every
# frame it takes or returns (3 float32 channels).
VAE_BYTES_PER_PIXEL = 128 * 4 * 3
PIXEL_BYTES = 3 * 4


def row_tokens(
    facts: Mapping[str, Any], height: int, width: int, frames: int = 1, sources: int = 0
) -> int:
    """Sequence tokens of one transformer row, from a family's facts (an adapter's
    `memory_facts()`, or MemoryModel's fields): the latent tokens of every latent frame (video:
    one per `frame_step` frames after the first), the text tokens, the source images' tokens."""
    per_frame = (height // facts["block"]) * (width // facts["block"]) * facts["block_tokens"]
    step = facts.get("frame_step", 0)
    latent_frames = 1 if not step else (frames - 1) // step + 1
    return (
        per_frame * latent_frames + facts["text_tokens"] + sources * facts.get("source_tokens", 0)
    )


@dataclass(frozen=True)
class MemoryModel:
    """One diffusion stage's activation budget and the family's facts its request cost needs."""

    budget_bytes: int  # activation bytes left for requests once the weights are loaded
    limit: str  # the setting that sets the budget, for messages ("memory_budget_gb=2")
    element_bytes: int  # bytes per activation element (the stage's dtype)
    hidden: int  # transformer width (heads x head dim)
    heads: int  # attention heads
    block: int  # the size grid: height and width are multiples of this many pixels
    block_tokens: int  # latent tokens of one block x block square of one (latent) frame
    text_tokens: int  # other tokens of every row (the padded prompt, fixed conditions)
    frame_step: int = 0  # output frames per latent frame after the first (video; 0: images)
    source_tokens: int = 0  # tokens one source image adds to every row (edits)
    source_pixels: int = 0  # pixels a source image is encoded at (0: the output's size)
    source_video: bool = False  # a source image is encoded as a video of the output's frames
    attention_scores: bool = True  # attention materialises its score matrix (math SDPA)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryModel:
        return cls(**data)

    def tokens(self, height: int, width: int, frames: int = 1, sources: int = 0) -> int:
        """Sequence tokens of one transformer row."""
        return row_tokens(dataclasses.asdict(self), height, width, frames, sources)

    def request_bytes(
        self,
        height: int,
        width: int,
        *,
        frames: int = 1,
        n: int = 1,
        cfg: bool = False,
        sources: int = 0,
    ) -> int:
        """Estimated activation bytes of one request: its rows of the forward, its decode and
        the encode of its source images."""
        tokens = self.tokens(height, width, frames, sources)
        e = self.element_bytes
        row = tokens * self.hidden * e * LINEAR_FACTOR
        if self.attention_scores:
            row += self.heads * tokens * tokens * e * SCORE_FACTOR
        rows = n * (2 if cfg else 1)
        decode = n * self._vae_bytes(height * width, frames)
        encoded = self.source_pixels or height * width
        encode = sources * self._vae_bytes(encoded, frames if self.source_video else 1)
        return rows * row + decode + encode

    def _vae_bytes(self, pixels: int, frames: int) -> int:
        at_once = min(frames, self.frame_step or 1)
        return pixels * (at_once * VAE_BYTES_PER_PIXEL + frames * PIXEL_BYTES)

    def refusal(
        self,
        height: int,
        width: int,
        *,
        frames: int = 1,
        n: int = 1,
        cfg: bool = False,
        sources: int = 0,
    ) -> tuple[str, str] | None:
        """(field to blame, message naming the limit) when the request cannot fit, else None."""
        need = self.request_bytes(height, width, frames=frames, n=n, cfg=cfg, sources=sources)
        if need <= self.budget_bytes:
            return None
        what = f"{width}x{height}"
        if self.frame_step:
            what = f"{frames} frames at {what}"
        what = f"{n} x {what}" if n > 1 else what
        if sources:
            what += f" with {sources} source image(s)"
        if cfg:
            what += ", CFG on"
        field = "n" if n > 1 else "num_frames" if self.frame_step and frames > 1 else "size"
        message = (
            f"needs about {need / 2**30:.2f} GiB of activations ({what}), more than the "
            f"{self.budget_bytes / 2**30:.2f} GiB left after the weights by {self.limit}; "
            "ask for fewer or smaller outputs"
        )
        return field, message
