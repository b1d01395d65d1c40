"""Random-weight diffusers pipelines for the diffusion benchmarks (no downloads, no vLLM).

FLUX ("small" for the CPU, "full" at FLUX.1-dev size), the GLM-Image DiT pipeline at full size,
and the tiny FLUX from make-tiny-model; `smoke` keeps a full architecture's shapes with one
block each, to check a code path on the CPU; and the timing helpers the step benchmarks share
(`time_ms`, `kernel_times`, `rel_err`). Used by bench_diffusion.py, bench_step_variants.py and
bench_dit_gpu.py.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = ["a red cube", "a photo of a cat", "a cat and a cube", "red", "the cat", "a photo"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def time_ms(fn, device: torch.device, warmup: int, iters: int) -> tuple[float, float]:
    """(median, min) ms of `fn`: CUDA events on the GPU, wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = call_times_ms(fn, device, iters)
    return statistics.median(times), min(times)


def call_times_ms(fn, device: torch.device, n: int) -> list[float]:
    """ms of each of `n` calls of `fn`: CUDA events on the GPU, wall clock on the CPU."""
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t))
    return times


def kernel_times(fn, device: torch.device) -> list[tuple[str, float]]:
    """(name, ms) of each kernel with device time over one call of `fn`, in the profiler's order:
    CUDA kernels on the GPU (ops would count their kernels twice), aten ops on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    rows = []
    for ev in prof.key_averages():
        if device.type == "cuda":
            us = ev.self_device_time_total if str(ev.device_type).endswith("CUDA") else 0
        else:
            us = ev.self_cpu_time_total if ev.key.startswith("aten::") else 0
        if us > 0:
            rows.append((ev.key, us / 1000))
    return rows


def flux_pipe(kind: str, device: torch.device, dtype: torch.dtype, smoke: bool = False):
    """FluxPipeline with random weights: "small" (CPU) or "full" (FLUX.1-dev-size transformer).

    `smoke` keeps the full architecture's shapes but one block each (checks the code path on CPU).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers import FluxTransformer2DModel as Flux
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from vllm_omni_plugin.testing.tiny_flux import build_clip_tokenizer, build_t5_tokenizer

    if kind == "small":  # 4 double + 8 single blocks, 4 heads x 64, joint dim 256
        tr_kw = dict(
            num_layers=4, num_single_layers=8, attention_head_dim=64, num_attention_heads=4
        )
        # A light VAE, so the DiT dominates as in real deployments (decode is the same on both sides).
        joint, pooled, vae_ch = 256, 64, (16, 32, 32, 32)
    else:  # FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128, joint dim 4096
        tr_kw = dict(
            num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24
        )
        joint, pooled, vae_ch = 4096, 768, (128, 256, 512, 512)
        if smoke:
            tr_kw.update(num_layers=1, num_single_layers=1)
    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in the target dtype (no fp32 copy)
    try:
        with torch.device(device):
            tr = Flux(
                patch_size=1,
                in_channels=64,
                joint_attention_dim=joint,
                pooled_projection_dim=pooled,
                guidance_embeds=True,
                axes_dims_rope=(16, 24, 24) if kind == "small" else (16, 56, 56),
                **tr_kw,
            )
            clip = CLIPTextModel(
                CLIPTextConfig(
                    vocab_size=1024,
                    hidden_size=pooled,
                    intermediate_size=2 * pooled,
                    num_hidden_layers=1,
                    num_attention_heads=4,
                    max_position_embeddings=77,
                    projection_dim=pooled,
                )
            )
            t5 = T5EncoderModel(
                T5Config(
                    vocab_size=512,
                    d_model=joint,
                    d_kv=64,
                    d_ff=2 * joint,
                    num_layers=1,
                    num_heads=max(1, joint // 64),
                )
            )
            vae = AutoencoderKL(
                in_channels=3,
                out_channels=3,
                latent_channels=16,
                down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4,
                block_out_channels=vae_ch,
                layers_per_block=1 if kind == "small" else 2,
                norm_num_groups=8 if kind == "small" else 32,
                scaling_factor=0.3611,
                shift_factor=0.1159,
                use_quant_conv=False,
                use_post_quant_conv=False,
            )
    finally:
        torch.set_default_dtype(prev)
    sched = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(sched, vae, clip, clip_tok, t5, t5_tok, tr)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def glm_pipe(device: torch.device, dtype: torch.dtype, smoke: bool = False):
    """GlmImagePipeline DiT stage with diffusers' default GLM transformer (no AR model)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline
    from diffusers import GlmImageTransformer2DModel as GlmDiT
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            # diffusers' defaults: 30 layers, 64 heads x 40 (2560 wide, 2.4B), smaller than the
            # published DiT (32 x 128, 6.9B: testing/full_glm_image.py, bench_dit_gpu.py)
            tr = GlmDiT(num_layers=1) if smoke else GlmDiT()
            t5 = T5EncoderModel(
                T5Config(
                    vocab_size=384, d_model=1472, d_kv=64, d_ff=2944, num_layers=1, num_heads=6
                )
            )
            lat = 16
            vae = AutoencoderKL(
                in_channels=3,
                out_channels=3,
                latent_channels=lat,
                down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4,
                block_out_channels=(128, 512, 1024, 1024),
                layers_per_block=2,
                norm_num_groups=32,
                latents_mean=[0.0] * lat,
                latents_std=[1.0] * lat,
            )
    finally:
        torch.set_default_dtype(prev)
    sched = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25,
        max_shift=0.75,
        base_image_seq_len=256,
        use_dynamic_shifting=True,
        time_shift_type="linear",
    )
    pipe = GlmImagePipeline(ByT5Tokenizer(), None, t5, None, vae, tr, sched)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux_pipe(model: str | None):
    from diffusers import FluxPipeline

    if model is None:
        from vllm_omni_plugin.testing.tiny_models import build_tiny_model

        model = str(build_tiny_model("flux", Path(tempfile.mkdtemp()) / "flux", seed=0))
    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return pipe
