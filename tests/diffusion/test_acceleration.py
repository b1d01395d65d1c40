"""Speed options of the denoising transformer (acceleration.py) on a tiny FLUX transformer.

The CUDA-only options are exercised by passing device "cuda" while the module stays on the CPU:
the option logic is the same, and the outputs must equal eager (the options are lossless).
The GPU timings are in BENCHMARKS.md (benchmarks/bench_diffusion.py --step-variants).
"""

from __future__ import annotations

import pytest
import torch
from tensor_checks import rel_err
from tiny_flux_dit import tiny_flux_step
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

from vllm_omni_plugin.diffusion.acceleration import (
    WithAttentionBackend,
    accelerate_transformer,
    reset_transformer,
)

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def flux():
    return tiny_flux_step()


def test_cuda_options_are_lossless_and_reversible(flux):
    tr, kw, ref = flux
    fn = accelerate_transformer(
        tr, CUDA, fuse_qkv=True, attention_backend="cudnn", cuda_graphs=False
    )
    try:
        assert isinstance(fn, WithAttentionBackend)
        assert fn.config.num_layers == 2  # adapters read the wrapped module's attributes
        attns = [b.attn for b in (*tr.transformer_blocks, *tr.single_transformer_blocks)]
        assert all(a.fused_projections and hasattr(a, "to_qkv") for a in attns)
        with torch.inference_mode():
            out = fn(**kw)[0]
        assert rel_err(out, ref) < 1e-5
    finally:
        reset_transformer(tr)
    assert not any(hasattr(b.attn, "to_qkv") for b in tr.transformer_blocks)
    with torch.inference_mode():
        assert torch.equal(tr(**kw)[0], ref)


def test_attention_backend_is_first_during_the_call_only():
    before = _cur_sdpa_kernel_backends(with_priority=True)
    seen = WithAttentionBackend(lambda: _cur_sdpa_kernel_backends(with_priority=True), "cudnn")()
    assert seen[0] == SDPBackend.CUDNN_ATTENTION
    # the others stay enabled as fallbacks for shapes cuDNN refuses
    assert {SDPBackend.FLASH_ATTENTION, SDPBackend.MATH} <= set(seen)
    assert _cur_sdpa_kernel_backends(with_priority=True) == before
    with pytest.raises(ValueError, match="attention_backend"):
        WithAttentionBackend(lambda: None, "fast")


def test_cpu_ignores_cuda_only_options(flux):
    tr, _, _ = flux
    fn = accelerate_transformer(tr, torch.device("cpu"), fuse_qkv=True, attention_backend="cudnn")
    assert fn is tr
    assert not tr.transformer_blocks[0].attn.fused_projections


def test_regional_compile_marks_every_repeated_block(flux):
    tr, _, _ = flux
    blocks = [*tr.transformer_blocks, *tr.single_transformer_blocks]
    fn = accelerate_transformer(tr, torch.device("cpu"), compile=True, regional=True)
    try:
        assert fn is tr  # the loop calls the module; its blocks run compiled
        assert all(b._compiled_call_impl is not None for b in blocks)
    finally:
        reset_transformer(tr)
    assert all(b._compiled_call_impl is None for b in blocks)
    whole = accelerate_transformer(tr, torch.device("cpu"), compile=True)
    assert isinstance(whole, torch._dynamo.eval_frame.OptimizedModule)
