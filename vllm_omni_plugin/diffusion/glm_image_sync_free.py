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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MODEL = "GlmImageTransformer2DModel"
# Latent sizes whose cos/sin stay on the device (a few KB to a few MB each).
MAX_CACHED_SIZES = 16


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
