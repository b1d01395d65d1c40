"""Lossless speed options for the denoising transformer (same math, faster kernels).

Each option keeps the model's function: no caching across steps, no lower precision.

  * `attention_backend`: which scaled-dot-product-attention kernel torch picks first
    ("cudnn", "flash", "efficient", "math"). On Hopper, cuDNN's attention is the fastest for
    bf16, head dim 128, where torch's default order starts with flash (v2 kernels). The
    others stay as fallbacks, so a shape cuDNN refuses still runs. CUDA only.
  * `fuse_qkv`: one Q|K|V projection GEMM instead of three (diffusers' own
    `fuse_qkv_projections`), for families whose attention processors read the fused weights.
    CUDA only (on CPU it only costs memory).
  * `compile`: torch.compile, either the whole forward or, with `regional`, each repeated
    block (diffusers' `_repeated_blocks`): the blocks are identical, so one compiled graph per
    block type serves them all and the compile takes seconds instead of minutes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# Transformers whose attention processors use the fused projections once they exist
# (for the others `fuse_qkv_projections` would only add unused weights).
QKV_FUSION_MODELS = frozenset({"FluxTransformer2DModel"})


class WithAttentionBackend:
    """Calls `fn` with `backend` first in torch's SDPA priority order.

    The context is entered around every call, so torch.compile traces (and bakes in) the
    chosen kernel on its first call, and eager calls pick it each time.
    """

    def __init__(self, fn: Callable[..., Any], backend: str) -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {sorted(ATTENTION_BACKENDS)}")
        first = ATTENTION_BACKENDS[backend]
        order = [first] + [b for b in ATTENTION_BACKENDS.values() if b != first]
        self.fn, self.backend, self._order = fn, backend, order

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with sdpa_kernel(self._order, set_priority=True):
            return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # config, dtype, ... of the wrapped module
        return getattr(self.fn, name)


def accelerate_transformer(
    transformer: torch.nn.Module,
    device: torch.device,
    *,
    compile: bool = False,
    regional: bool = False,
    mode: str | None = None,
    fullgraph: bool = False,
    fuse_qkv: bool = False,
    attention_backend: str | None = None,
) -> Callable[..., Any]:
    """Apply the options to `transformer` (fusion and regional compile are in place) and
    return what the denoising loop should call."""
    cuda = device.type == "cuda"
    if fuse_qkv:
        if not cuda:
            logger.info("fuse_qkv ignored on %s (CUDA only)", device)
        elif type(transformer).__name__ in QKV_FUSION_MODELS:
            transformer.fuse_qkv_projections()
        else:
            logger.info("fuse_qkv not supported for %s; ignored", type(transformer).__name__)
    fn: Callable[..., Any] = transformer
    if compile:
        kwargs: dict[str, Any] = {"mode": mode, "fullgraph": fullgraph}
        if regional and getattr(transformer, "_repeated_blocks", None):
            for block in _repeated_blocks(transformer):
                block.compile(**kwargs)
        else:
            fn = torch.compile(transformer, **kwargs)
    if attention_backend is not None:
        if cuda:
            fn = WithAttentionBackend(fn, attention_backend)
        else:
            logger.info("attention_backend ignored on %s (CUDA only)", device)
    return fn


def reset_transformer(transformer: torch.nn.Module) -> None:
    """Undo `accelerate_transformer`'s in-place changes (benchmarks compare variants)."""
    for block in _repeated_blocks(transformer):
        block._compiled_call_impl = None  # what nn.Module.compile sets
    if getattr(transformer, "fuse_qkv_projections", None) is not None:
        transformer.unfuse_qkv_projections()


def _repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    return [m for m in transformer.modules() if type(m).__name__ in names]
