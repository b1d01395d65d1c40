"""`fuse_gelu` (gelu_epilogue.py) on a tiny random FLUX transformer, float32, CPU.

On CPU the fused module computes the unfused ops (`_addmm_activation`'s CPU GELU is the exact
erf, not the tanh the blocks use), and the single blocks' split proj_out sums the same products
in two GEMMs, so the step equals the unfused one within float32 rounding; the CUDA call's
plumbing (`addmm_gelu`) is checked against the erf GELU it computes here. The GPU
timing: the "fuse_gelu" rows of benchmarks/dit_sections.py and benchmarks/bench_dit_ab.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
from tensor_checks import rel_err
from tiny_flux_dit import DOUBLE, SINGLE, tiny_flux_step
from torch import nn
from torch._inductor.utils import run_and_get_code

from vllm_omni_plugin.diffusion.acceleration import accelerate_transformer, reset_transformer
from vllm_omni_plugin.diffusion.gelu_epilogue import (
    LinearGeluTanh,
    addmm_gelu,
    fuse_block_gelus,
    restore,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def flux():
    return tiny_flux_step()


def mlp_modules(tr):
    """The modules fuse_gelu replaces: per double block ff.net[0], ff_context.net[0]; per
    single block proj_mlp, act_mlp."""
    out = []
    for b in tr.transformer_blocks:
        out += [b.ff.net[0], b.ff_context.net[0]]
    for b in tr.single_transformer_blocks:
        out += [b.proj_mlp, b.act_mlp]
    return out


def test_fused_step_equals_unfused_and_reset_restores(flux):
    tr, kw, ref = flux
    before = mlp_modules(tr)
    fn = accelerate_transformer(tr, CPU, fuse_gelu=True)
    try:
        assert fn is tr
        fused = [m for m in tr.modules() if isinstance(m, LinearGeluTanh)]
        # two tanh-GELU FeedForwards per double block, one proj_mlp + act_mlp per single block
        assert len(fused) == 2 * DOUBLE + SINGLE
        assert all(type(b.act_mlp) is nn.Identity for b in tr.single_transformer_blocks)
        assert not any(type(m) is GELU for m in tr.modules())
        block = tr.single_transformer_blocks[0]
        assert block.proj_mlp.weight is before[2 * DOUBLE].weight  # shared, not copied
        assert all("forward" in b.__dict__ for b in tr.single_transformer_blocks)
        with torch.inference_mode():
            out = fn(**kw)[0]
        # the unfused ops, proj_out's sum split in two GEMMs: within 1e-6 relative (float32)
        assert 0 < rel_err(out, ref) < 1e-6
    finally:
        reset_transformer(tr)
    assert all(a is b for a, b in zip(mlp_modules(tr), before, strict=True))
    assert not any("forward" in b.__dict__ for b in tr.single_transformer_blocks)
    assert not any(isinstance(m, LinearGeluTanh) for m in tr.modules())
    with torch.inference_mode():
        assert torch.equal(tr(**kw)[0], ref)


def test_split_proj_out_falls_back_when_proj_out_is_not_a_linear(flux):
    """fp8 swaps proj_out after fuse_gelu: the block then feeds it the concatenation."""
    tr, kw, ref = flux
    undo = fuse_block_gelus(list(tr.single_transformer_blocks))
    block = tr.single_transformer_blocks[0]
    original = block.proj_out
    seen = []

    class Wrapped(nn.Module):
        def forward(self, x):
            seen.append(x.shape[-1])
            return original(x)

    block.proj_out = Wrapped()
    try:
        with torch.inference_mode():
            out = tr(**kw)[0]
        assert seen == [original.in_features]  # attn + mlp channels, concatenated
        assert rel_err(out, ref) < 1e-6
    finally:
        block.proj_out = original
        restore(undo)


def test_exact_gelu_and_biasless_linears_are_left_alone():
    torch.manual_seed(0)
    exact_ff = FeedForward(dim=32, dim_out=32, activation_fn="gelu")  # erf GELU
    assert type(exact_ff.net[0]) is GELU and exact_ff.net[0].approximate == "none"
    exact_single = FluxSingleTransformerBlock(32, 2, 16)
    exact_single.act_mlp = nn.GELU()
    biasless = FeedForward(dim=32, dim_out=32, activation_fn="gelu-approximate", bias=False)
    blocks = [exact_ff, exact_single, biasless]
    assert fuse_block_gelus(blocks) == []
    tanh_ff = FeedForward(dim=32, dim_out=32, activation_fn="gelu-approximate")
    original = tanh_ff.net[0]
    undo = fuse_block_gelus([tanh_ff])
    assert len(undo) == 1 and isinstance(tanh_ff.net[0], LinearGeluTanh)
    x = torch.randn(2, 5, 32)
    expected = F.gelu(original.proj(x), approximate="tanh")
    assert torch.equal(tanh_ff.net[0](x), expected)
    restore(undo)
    assert tanh_ff.net[0] is original


def test_cuda_call_plumbing_on_cpu():
    """addmm_gelu is what LinearGeluTanh calls on CUDA: rows of any leading shape, W.T, bias.
    Its CPU GELU is the exact erf (the reason the module does not call it on CPU)."""
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(2, 7, 24, generator=g)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    lin = F.linear(x, w, b)
    out = addmm_gelu(x, w, b)
    assert out.shape == (2, 7, 40)
    # float32 GEMM accumulation order: within 1e-5 of linear + erf GELU
    torch.testing.assert_close(out, F.gelu(lin), rtol=1e-5, atol=1e-5)
    assert (out - F.gelu(lin, approximate="tanh")).abs().max() > 1e-4  # not tanh on CPU


def test_inductor_keeps_the_epilogue_call():
    """Compiled, `_addmm_activation` stays one extern call (no addmm + gelu decomposition)."""
    torch._dynamo.reset()
    x, w, b = torch.randn(16, 24), torch.randn(40, 24), torch.randn(40)
    compiled = torch.compile(addmm_gelu)
    with torch.inference_mode():
        out, (code, *_) = run_and_get_code(compiled, x, w, b)
        torch.testing.assert_close(out, addmm_gelu(x, w, b), rtol=1e-6, atol=1e-6)
    assert "aten._addmm_activation" in code
    assert "gelu" not in code.replace("_addmm_activation", "").replace("use_gelu", "")
    torch._dynamo.reset()


def test_fused_regional_compile_equals_eager(flux):
    tr, kw, ref = flux
    torch._dynamo.reset()
    fn = accelerate_transformer(tr, CPU, fuse_gelu=True, compile=True, regional=True)
    try:
        with torch.inference_mode():
            out = fn(**kw)[0]
        # inductor reorders float32 sums: within 1e-5 relative of eager
        assert rel_err(out, ref) < 1e-5
    finally:
        reset_transformer(tr)
        torch._dynamo.reset()
    assert not any(isinstance(m, LinearGeluTanh) for m in tr.modules())
