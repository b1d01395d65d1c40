"""GLM-Image's transformer forward without host synchronisations, bit for bit the same math.

diffusers 0.42's `GlmImageTransformer2DModel.forward` stops the host twice per call:

  * RoPE: `GlmImageRotaryPosEmbed` builds cos/sin with `torch.arange` on the CPU on every call,
    and every block's attention copies them to the GPU (`apply_rotary_emb`: `cos.to(x.device)`
    for the query and again for the key). A pageable host-to-device copy waits until the GPU has
    drained the stream, so at 30 layers the host stalls 60+ times per forward and can never
    queue kernels ahead of the GPU; inside a CUDA graph capture such a copy is an error.
  * the CFG prior drop, `prior_embedding[prior_token_drop] *= 0.0`, indexes with a boolean mask,
    which needs the count of True entries on the host: a device-to-host sync (and, again, an
    error inside a capture).

`install` replaces the two submodules: the RoPE module computes cos/sin with the same CPU code
once per latent size and keeps them on the device; the prior embedding multiplies its output
by a keep mask (1.0 or 0.0 per token: x * 1.0 == x, and x * 0.0 is what the masked multiply
gives). `SyncFreeGlm` wraps the call: it sets the keep mask from `prior_token_drop` on the
device and passes the forward an empty slice as its drop mask, so the forward's own masked
multiply touches nothing.

`warm_up` compiles ahead of the first request: with dynamic shapes (acceleration.py) the
compiled block serves every batch size, text length and resolution, except that torch
specialises sizes 1, so there are four graphs per block type (batch 1 or more, glyph length 1
or more). Without it the first request with quoted text (cond and uncond rows of different
lengths: two batch-1 forwards) paid those compiles, ~19 s, in the middle of serving (seen on an H200).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

MODEL = "GlmImageTransformer2DModel"
# Latent sizes whose cos/sin stay on the device (a few KB to a few MB each).
MAX_CACHED_SIZES = 16
# The warm-up's shape classes: (batch, glyph length). Sizes other than 1 are chosen distinct
# from each other and from the image token count, so no two dimensions share a symbol.
WARM_UP_CLASSES = ((2, 3), (2, 1), (1, 3), (1, 1))
WARM_UP_LATENT = 32  # 256x256 images: cheap, and the graphs are shape-generic


class DeviceRope(nn.Module):
    """`GlmImageRotaryPosEmbed` with its output cached on the device, per latent size."""

    def __init__(self, rope: nn.Module) -> None:
        super().__init__()
        self.rope = rope
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch._dynamo.disable  # a cache lookup, not math: keep it out of whole-model graphs
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (*hidden_states.shape[2:], hidden_states.device)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= MAX_CACHED_SIZES:
                self._cache.pop(next(iter(self._cache)))
            cos, sin = self.rope(hidden_states)
            hit = (cos.to(hidden_states.device), sin.to(hidden_states.device))
            self._cache[key] = hit
        return hit


class KeepMaskedEmbedding(nn.Module):
    """The prior token embedding, times the keep mask that `SyncFreeGlm` sets per call."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.keep: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.embedding(ids)
        if self.keep is not None:
            out = out * self.keep.unsqueeze(-1).to(out.dtype)
        return out


def install(transformer: nn.Module) -> Callable[[], None] | None:
    """Swap in the sync-free submodules (GLM-Image only); returns the undo, or None."""
    if type(transformer).__name__ != MODEL:
        return None
    rope, emb = transformer.rope, transformer.prior_token_embedding
    if isinstance(rope, DeviceRope):  # already installed
        return None
    transformer.rope = DeviceRope(rope)
    transformer.prior_token_embedding = KeepMaskedEmbedding(emb)

    def undo() -> None:
        transformer.rope, transformer.prior_token_embedding = rope, emb

    return undo


class SyncFreeGlm:
    """Calls `fn` (the GLM transformer, compiled or not) with the drop applied as a keep mask."""

    def __init__(self, fn: Callable[..., Any], transformer: nn.Module) -> None:
        self.fn = fn
        self._embedding = transformer.prior_token_embedding
        if not isinstance(self._embedding, KeepMaskedEmbedding):
            raise TypeError("glm_image_sync_free.install(transformer) must run first")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        drop = kwargs.get("prior_token_drop")
        if args or not isinstance(drop, torch.Tensor):
            return self.fn(*args, **kwargs)
        self._embedding.keep = ~drop
        try:
            return self.fn(**{**kwargs, "prior_token_drop": slice(0, 0)})
        finally:
            self._embedding.keep = None

    def __getattr__(self, name: str) -> Any:  # config, dtype, ... of the wrapped module
        if name == "fn":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)


def warm_up_inputs(transformer: nn.Module, batch: int, glyph_len: int) -> dict[str, Any]:
    """Inputs of one forward in the GLM adapter's layout, at WARM_UP_LATENT, random values."""
    cfg = transformer.config
    device, dtype = transformer.device, transformer.dtype
    lat = WARM_UP_LATENT
    tokens = (lat // cfg.patch_size) ** 2
    size = float(lat * 8)
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, lat, lat, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(
            batch, glyph_len, cfg.text_embed_dim, device=device, dtype=dtype
        ),
        prior_token_id=torch.zeros(batch, tokens, dtype=torch.long, device=device),
        prior_token_drop=torch.zeros(batch, tokens, dtype=torch.bool, device=device),
        timestep=torch.full([batch], 500.0, device=device, dtype=dtype),
        target_size=torch.tensor([[size, size]] * batch, device=device, dtype=dtype),
        crop_coords=torch.zeros(batch, 2, device=device, dtype=dtype),
        attention_kwargs=None,
        return_dict=False,
    )


@torch.inference_mode()
def warm_up(fn: Callable[..., Any], transformer: nn.Module) -> float:
    """Run `fn` once per shape class so every compile happens now; returns the seconds spent."""
    t0 = time.perf_counter()
    for batch, glyph_len in WARM_UP_CLASSES:
        fn(**warm_up_inputs(transformer, batch, glyph_len))
    if transformer.device.type == "cuda":
        torch.cuda.synchronize(transformer.device)
    spent = time.perf_counter() - t0
    logger.info("GLM-Image transformer compiled for %d shape classes in %.1f s", 4, spent)
    return spent
