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
    block type serves them all and the compile takes seconds instead of minutes. What inductor
    compiled is kept on disk (compile_cache.py), so a restarted stage loads it.
  * `dynamic`: torch.compile's `dynamic`. Left to torch (None), dynamo compiles the first shape
    statically, recompiles when a dimension changes (then with that dimension symbolic), and
    specialises sizes 0 and 1, so the first requests of a server each pay a compile (seconds
    per block type) until the shape classes are seen; past the recompile limit (8) a new shape
    silently runs eager. Families whose text length changes with every prompt (GLM-Image's
    glyph text, Qwen-Image's prompt) therefore compile with dynamic=True: at most four graphs
    per block type (batch 1 or more, text length 1 or more), no further recompiles.
  * `cuda_graphs` (cuda_graphs.py): the forward captured per input signature and replayed.
  * `fuse_gelu` (gelu_epilogue.py): the blocks' MLP up-projection + tanh-GELU as one GEMM
    with cuBLASLt's bias+GELU epilogue (the same function, not the same bits), and FLUX's
    single-block proj_out as two GEMMs so the attention|MLP concat is never written. Off here;
    the engine turns it on for CUDA devices (`DiffusionEngineConfig.fuse_gelu`), where an
    interleaved A/B measured it faster. On CPU the swapped modules compute the unfused math.
  * `fp8` (fp8.py): fp8 GEMMs for the block linears; lossy, opt-in, sm89+ only.
  * GLM-Image always runs without its forward's host syncs (glm_image_sync_free.py): the same
    math, and the precondition for capturing it in a CUDA graph. Compiled on CUDA, its four
    shape classes are compiled at start-up (`warm_up`), not in the first requests.
  * The Qwen-Image family's transformers always run without the forward's host-to-device
    copies (qwen_image_sync_free.py): the text length of padded text batches (batch > 1,
    prompts of different lengths) and Qwen-Image-Edit-2511's `modulate_index` (`zero_cond_t`).
    The same math, and what lets those shapes be captured in a CUDA graph.
  * The Qwen-Image family's joint attention runs per row, unmasked, when a batch's prompts
    differ in length (qwen_image_rows.py): each prompt's own attention, as alone, instead of a
    masked kernel over the padded batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import fp8 as fp8_gemm
from . import gelu_epilogue, glm_image_sync_free, qwen_image_rows, qwen_image_sync_free
from .compile_cache import use_compile_cache
from .cuda_graphs import StepGraphs

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
# Transformers whose text length changes per prompt: compiled with dynamic shapes by default.
VARIABLE_TEXT_MODELS = frozenset({"GlmImageTransformer2DModel", "QwenImageTransformer2DModel"})


class AccelerationError(ValueError):
    """An option the device cannot honour (raised at engine start, naming the option)."""


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
        if name == "fn":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)


def accelerate_transformer(
    transformer: torch.nn.Module,
    device: torch.device,
    *,
    compile: bool = False,
    regional: bool = False,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    fuse_qkv: bool = False,
    attention_backend: str | None = None,
    cuda_graphs: bool | None = None,
    max_graphs: int = 8,
    fp8: bool = False,
    fuse_gelu: bool = False,
    reversible: bool = True,
    compile_cache_dir: str | None = None,
) -> Callable[..., Any]:
    """Apply the options to `transformer` (fusion, fp8, GLM's sync-free modules and regional
    compile are in place; `reset_transformer` undoes them) and return what the denoising loop
    should call. `dynamic=None`: dynamic for VARIABLE_TEXT_MODELS, else torch's default.
    `cuda_graphs=None`: on for CUDA devices. `reversible=False` (serving) frees what only
    `reset_transformer` would need (fp8: the model-dtype weights of the swapped linears).
    `compile_cache_dir`: inductor's on-disk cache (compile_cache.py; None: its default)."""
    cuda = device.type == "cuda"
    name = type(transformer).__name__
    undo: list[Callable[[], None]] = transformer.__dict__.setdefault("_omni_undo", [])
    if fuse_qkv:
        if not cuda:
            logger.info("fuse_qkv ignored on %s (CUDA only)", device)
        elif name in QKV_FUSION_MODELS:
            transformer.fuse_qkv_projections()
        else:
            logger.info("fuse_qkv not supported for %s; ignored", name)
    if fuse_gelu:
        # Before fp8: the fused modules hold no nn.Linear (fp8 swaps `type(m) is nn.Linear`),
        # so with both, the MLP up-projections keep the model dtype and their GELU epilogue.
        fused = gelu_epilogue.fuse_block_gelus(_repeated_blocks(transformer))
        if reversible:
            undo.append(lambda: gelu_epilogue.restore(fused))
        n = sum(isinstance(m, gelu_epilogue.LinearGeluTanh) for m in transformer.modules())
        logger.info("fuse_gelu: %d MLP up-projections with a GELU epilogue", n)
    if fp8:
        why = fp8_gemm.fp8_supported(device)
        if why is not None:
            raise AccelerationError(f"fp8_linear: {why}")
        swapped = fp8_gemm.quantize_block_linears(_repeated_blocks(transformer))
        if reversible:
            undo.append(lambda: fp8_gemm.restore_linears(swapped))
        logger.info("fp8_linear: %d block linears run as fp8 GEMMs", len(swapped))
    sync_free = glm_image_sync_free.install(transformer)
    if sync_free is not None:
        undo.append(sync_free)
    qwen_undo = qwen_image_sync_free.install(transformer)
    if qwen_undo is not None:
        undo.append(qwen_undo)
    rows_undo = qwen_image_rows.install(transformer)
    if rows_undo is not None:
        undo.append(rows_undo)
    fn: Callable[..., Any] = transformer
    if compile:
        logger.info("torch.compile cache: %s", use_compile_cache(compile_cache_dir))
        if dynamic is None and name in VARIABLE_TEXT_MODELS:
            dynamic = True
        kwargs: dict[str, Any] = {"mode": mode, "fullgraph": fullgraph, "dynamic": dynamic}
        if regional and getattr(transformer, "_repeated_blocks", None):
            for block in _repeated_blocks(transformer):
                block.compile(**kwargs)
        else:
            fn = torch.compile(transformer, **kwargs)
    if sync_free is not None:
        fn = glm_image_sync_free.SyncFreeGlm(fn, transformer)
        if compile and cuda and dynamic:
            # All of GLM's compiles now, at start-up, instead of in the first requests.
            glm_image_sync_free.warm_up(fn, transformer)
    if qwen_image_sync_free.holder(transformer) is not None:
        fn = qwen_image_sync_free.SyncFreeQwen(fn, transformer)
    if attention_backend is not None:
        if cuda:
            fn = WithAttentionBackend(fn, attention_backend)
        else:
            logger.info("attention_backend ignored on %s (CUDA only)", device)
    if cuda_graphs is None:
        cuda_graphs = cuda
    if cuda_graphs:
        if cuda:
            fn = StepGraphs(fn, device, max_graphs=max_graphs)
        else:
            logger.info("cuda_graphs ignored on %s (CUDA only)", device)
    return fn


def reset_transformer(transformer: torch.nn.Module) -> None:
    """Undo `accelerate_transformer`'s in-place changes (benchmarks compare variants)."""
    undo = transformer.__dict__.get("_omni_undo") or []
    while undo:  # newest first; fp8 puts back the fused Linear before the unfuse drops it
        undo.pop()()
    for block in _repeated_blocks(transformer):
        block._compiled_call_impl = None  # what nn.Module.compile sets
    if getattr(transformer, "fuse_qkv_projections", None) is not None:
        transformer.unfuse_qkv_projections()


def _repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    return [m for m in transformer.modules() if type(m).__name__ in names]
