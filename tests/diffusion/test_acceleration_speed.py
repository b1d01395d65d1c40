"""The DiT speed options on CPU: what can run here runs for real, the rest is shown wired.

  * GLM-Image without its forward's host syncs (glm_image_sync_free.py): bit-identical to
    diffusers' forward, reversible.
  * Regional torch.compile (inductor, the lossless path) equals eager within 1e-5 relative, and
    with GLM's dynamic text dimension new prompt lengths reuse the one graph (the recompiles the
    served GLM-Image DiT paid on its first requests, BENCHMARKS.md).
  * CUDA graphs (cuda_graphs.py): capture needs a GPU; here a capture fails for real (no CUDA)
    and the shape must fall back to the uncaptured forward with the same output.
  * fp8 GEMMs (fp8.py): the per-row scaled matmul runs on CPU too (torch._scaled_mm), so its
    math is checked against a dequantized reference; the knob is refused on devices without
    fp8 tensor cores, at config load (device: cpu) and at engine start.
GPU timings: benchmarks/bench_dit_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel
from pydantic import ValidationError
from tensor_checks import rel_err
from tiny_glm_dit import glm_inputs, reference, tiny_glm_dit

from vllm_omni_plugin.config.owners_diffusion import DiffusionOwner
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, glm_image_sync_free
from vllm_omni_plugin.diffusion.acceleration import (
    AccelerationError,
    accelerate_transformer,
    reset_transformer,
)
from vllm_omni_plugin.diffusion.cuda_graphs import StepGraphs, same_device, signature
from vllm_omni_plugin.diffusion.errors import DiffusionEngineError
from vllm_omni_plugin.diffusion.fp8 import Fp8Linear, quantize_block_linears, restore_linears
from vllm_omni_plugin.diffusion.glm_image_sync_free import DeviceRope, SyncFreeGlm

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def glm():
    return tiny_glm_dit()


@torch.inference_mode()
def test_glm_without_host_syncs_is_bit_identical_and_reversible(glm):
    kw = glm_inputs(3)
    ref = reference(glm, kw)
    fn = accelerate_transformer(glm, CPU)
    try:
        assert isinstance(fn, SyncFreeGlm) and isinstance(glm.rope, DeviceRope)
        assert fn.config.num_layers == 2  # adapters read the wrapped module's attributes
        out = fn(**kw)[0]
        assert torch.equal(out, ref)  # same math, bit for bit (dropped rows included)
        cos = glm.rope._cache[(8, 8, CPU)][0]
        fn(**kw)
        assert glm.rope._cache[(8, 8, CPU)][0] is cos  # computed once per latent size
        assert glm.prior_token_embedding.keep is None  # the keep mask lives for one call
        # the drop must act: without it the unconditional row would differ
        kept = fn(**{**kw, "prior_token_drop": torch.zeros(2, 16, dtype=torch.bool)})[0]
        assert not torch.equal(kept[1], out[1]) and torch.equal(kept[0], out[0])
        # the start-up warm-up's inputs are the adapter's layout (GPU compiles run it)
        assert glm_image_sync_free.warm_up(fn, glm) >= 0
    finally:
        reset_transformer(glm)
    assert type(glm.rope).__name__ == "GlmImageRotaryPosEmbed"
    assert torch.equal(reference(glm, kw), ref)


@torch.inference_mode()
def test_regional_compile_equals_eager_and_new_text_lengths_do_not_recompile(glm):
    """Inductor on CPU, dynamic text dimension (GLM's default): tolerance 1e-5 relative (fp32;
    inductor reorders reductions)."""
    inputs = {n: glm_inputs(n, seed=n) for n in (3, 5, 9)}
    refs = {n: reference(glm, kw) for n, kw in inputs.items()}
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    fn = accelerate_transformer(glm, CPU, compile=True, regional=True)
    try:
        for n, kw in inputs.items():
            assert rel_err(fn(**kw)[0], refs[n]) < 1e-5, n
        # one graph for the block type, whatever the prompt's text length
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        reset_transformer(glm)
        torch._dynamo.reset()


def test_failed_cuda_graph_capture_falls_back_to_the_same_output():
    calls = []

    def forward(*, x, scale):
        calls.append(x.shape)
        return (x * scale,)

    graphs = StepGraphs(forward, CPU, max_graphs=2)  # CPU: the capture cannot succeed here
    x = torch.randn(3, 4)
    assert torch.equal(graphs(x=x, scale=2.0)[0], x * 2)  # first call of a shape: uncaptured
    assert torch.equal(graphs(x=x, scale=2.0)[0], x * 2)  # second: capture fails, falls back
    assert graphs.stats["failures"] == 1 and graphs.stats["captures"] == 0
    assert torch.equal(graphs(x=x, scale=2.0)[0], x * 2)  # never retried for that shape
    assert graphs.stats["failures"] == 1 and len(calls) >= 3
    # signatures: shape, dtype and plain values count; tensors elsewhere are not replayable
    assert signature({"x": x}, CPU) == signature({"x": torch.zeros(3, 4)}, CPU)
    assert signature({"x": x}, CPU) != signature({"x": torch.zeros(2, 4)}, CPU)
    assert signature({"x": x, "s": 1.0}, CPU) != signature({"x": x, "s": 2.0}, CPU)
    assert signature({"x": x}, torch.device("cuda")) is None
    # a device named with or without its index is the same device (the engine's is "cuda", its
    # tensors' "cuda:0": equality of the two left every H200 forward uncaptured)
    assert signature({"x": x}, torch.device("cpu", 0)) == signature({"x": x}, CPU)
    assert same_device(torch.device("cpu", 0), CPU) and not same_device(CPU, torch.device("meta"))
    assert signature({"x": x, "f": object()}, CPU) is None


def test_cuda_graphs_on_by_default_for_cuda_only(glm):
    cuda = accelerate_transformer(glm, torch.device("cuda"))  # module on CPU: wiring only
    try:
        assert isinstance(cuda, StepGraphs)
        assert cuda.config.num_layers == 2
        kw = glm_inputs(3)
        with torch.inference_mode():  # CPU tensors for a CUDA device: not captured, still right
            assert torch.equal(cuda(**kw)[0], reference(glm, kw))
        assert cuda.stats["uncaptured"] == 1
    finally:
        reset_transformer(glm)
    cpu = accelerate_transformer(glm, CPU, cuda_graphs=True)
    reset_transformer(glm)
    assert not isinstance(cpu, StepGraphs)


@torch.inference_mode()
def test_fp8_linear_is_the_per_row_scaled_product():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    x[0, 0] *= 50  # an outlier token: per-row scales keep it from flattening the other rows
    q = Fp8Linear(lin)
    out = q(x)
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16
    # reference: dequantize both operands, multiply in float32
    w = q.weight_fp8.float() * q.weight_scale.t()
    x2 = x.reshape(-1, 64).float()
    amax = x2.abs().amax(-1, keepdim=True)
    xs = amax / 448
    xq = (x2 / xs).clamp(-448, 448).to(torch.float8_e4m3fn).float() * xs
    ref = (xq @ w.t() + lin.bias.float()).reshape(2, 5, 48)
    assert rel_err(out, ref) < 1e-2  # only the bf16 rounding of the output
    exact = lin(x).float()
    assert rel_err(out[1], exact[1]) < 0.08  # fp8 e4m3 (3 mantissa bits): a few % per product


def test_fp8_swaps_block_linears_except_modulation_and_restores():
    torch.manual_seed(0)
    tr = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    blocks = [*tr.transformer_blocks, *tr.single_transformer_blocks]
    swapped = quantize_block_linears(blocks)
    names = {n for b in blocks for n, m in b.named_modules() if isinstance(m, Fp8Linear)}
    assert {"attn.to_q", "attn.to_out.0", "ff.net.2", "proj_mlp", "proj_out"} <= names
    assert not any("norm" in n for n in names)  # adaLN modulation stays in the model dtype
    restore_linears(swapped)
    assert not any(isinstance(m, Fp8Linear) for m in tr.modules())


def test_fp8_knob_is_wired_and_refused_where_unsupported(glm, tiny_models):
    with pytest.raises(AccelerationError, match="fp8_linear: .*compute capability >= 8.9"):
        accelerate_transformer(glm, CPU, fp8=True)
    reset_transformer(glm)
    with pytest.raises(ValidationError, match="fp8_linear"):
        DiffusionOwner(device="cpu", fp8_linear=True)
    owner = DiffusionOwner(fp8_linear=True, cuda_graphs=False, cuda_graph_max_graphs=3)
    cfg = DiffusionEngineConfig.from_owner(owner, model=str(tiny_models("flux")))
    assert (cfg.fp8_linear, cfg.cuda_graphs, cfg.cuda_graph_max_graphs) == (True, False, 3)
    cfg.device, cfg.dtype = "cpu", "float32"
    with pytest.raises(DiffusionEngineError, match="fp8_linear"):
        DiffusionEngine(cfg)
