"""Diffusion engine vs diffusers' own pipeline, side by side on the same weights and settings.

    python benchmarks/bench_diffusion.py                      # CPU: tiny + small FLUX configs
    python benchmarks/bench_diffusion.py --config tiny --model DIR   # tiny from make-tiny-model
    python benchmarks/bench_diffusion.py --gpu                # full-size FLUX.1-dev + GLM-Image DiT

Needs only torch + diffusers + transformers + this package (no vLLM). All weights are random
and built in-process (no downloads); GPU configs are built directly on the GPU in bf16.

Measured per config:
  * latency at concurrency 1: one request at a time (best of --repeats: the CPU machine is
    shared, and the minimum is the statistic least moved by other people's load);
  * images/s at concurrency 8: 8 requests (different prompts and seeds) in flight. diffusers
    serves them one pipeline call each (what a diffusers-backed server does); the engine gets
    all 8 at once and batches them step by step;
  * GPU configs also: one denoising step, transformer only, batch 1: diffusers eager forward
    vs the engine's denoise step (eager, and torch.compile with --compile);
  * max |engine - diffusers| mean pixel difference over the compared images (sanity).
Prints a table, then one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.adapters.flux import FluxAdapter
from vllm_omni_plugin.diffusion.adapters.glm_image import GlmImageAdapter

PROMPTS = ["a red cube", "a photo of a cat", "a cat and a cube", "red", "the cat", "a photo"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- model builders (random weights) ------------------------------------------------------
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
    """GlmImagePipeline DiT stage with a GLM-Image-size transformer (no AR model)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline
    from diffusers import GlmImageTransformer2DModel as GlmDiT
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            # diffusers' defaults are GLM-Image's DiT: 30 layers, 64 heads x 40
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


# ---- measurement ------------------------------------------------------------------------
class Case:
    """One config: a pipeline, an engine sharing its weights, and how to call each."""

    def __init__(self, name, pipe, adapter_cls, size, steps, device, dtype, compile_=False):
        self.name, self.pipe, self.size, self.steps = name, pipe, size, steps
        self.device, self.dtype = device, dtype
        self.glm = adapter_cls is GlmImageAdapter
        adapter = adapter_cls(pipe, device, dtype, {})
        self.engine = DiffusionEngine(
            DiffusionEngineConfig(
                model=name,
                device=str(device),
                dtype=str(dtype).split(".")[-1],
                max_batch_size=8,
                compile_transformer=compile_,
            ),
            adapter=adapter,
        )
        grid = size // 16
        gen = torch.Generator("cpu").manual_seed(0)
        codebook = pipe.transformer.config.get("prior_vq_quantizer_codebook_size", 16384)
        self.priors = [
            torch.randint(0, codebook, (1, grid * grid), generator=gen) for _ in range(8)
        ]
        self._n = 0

    def request(self, i: int) -> GenerationRequest:
        self._n += 1
        return GenerationRequest(
            f"r{self._n}",
            PROMPTS[i % len(PROMPTS)],
            height=self.size,
            width=self.size,
            num_inference_steps=self.steps,
            guidance_scale=1.5 if self.glm else 3.5,
            seed=i,
            prior_token_ids=self.priors[i % 8] if self.glm else None,
        )

    def diffusers(self, r: GenerationRequest):
        kw = {"prior_token_ids": r.prior_token_ids.to(self.device)} if self.glm else {}
        return self.pipe(
            r.prompt,
            height=r.height,
            width=r.width,
            num_inference_steps=r.num_inference_steps,
            guidance_scale=r.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(r.seed),
            **kw,
        ).images[0]

    def timed(self, fn):
        sync(self.device)
        t = time.perf_counter()
        out = fn()
        sync(self.device)
        return time.perf_counter() - t, out


def pixel_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


def run_case(case: Case, repeats: int, step_time: bool, compile_: bool = False) -> dict:
    # Warm-up both paths (allocator, lazy inits, compile).
    case.diffusers(case.request(0))
    case.engine.generate([case.request(0)])
    if case.device.type == "cuda":  # batch-8 shapes get their kernels/allocations before timing
        case.engine.generate([case.request(i) for i in range(8)])
    lat_d, lat_e, diffs = [], [], []
    for i in range(repeats):  # interleaved, so machine noise hits both alike
        r = case.request(i)
        dt, img_d = case.timed(lambda r=r: case.diffusers(r))
        lat_d.append(dt)
        dt, (out,) = case.timed(lambda r=r: case.engine.generate([r]))
        lat_e.append(dt)
        diffs.append(pixel_diff(img_d, out.images[0]))
    tput_d, tput_e = [], []
    for _ in range(repeats):
        reqs = [case.request(i) for i in range(8)]
        dt, imgs_d = case.timed(lambda reqs=reqs: [case.diffusers(r) for r in reqs])
        tput_d.append(8 / dt)
        dt, outs = case.timed(lambda reqs=reqs: case.engine.generate(reqs))
        tput_e.append(8 / dt)
        diffs += [pixel_diff(a, o.images[0]) for a, o in zip(imgs_d, outs, strict=True)]
    res = {
        "config": case.name,
        "size": case.size,
        "steps": case.steps,
        "dtype": str(case.dtype),
        "c1_latency_s": {"diffusers": min(lat_d), "engine": min(lat_e)},
        "c8_images_per_s": {"diffusers": max(tput_d), "engine": max(tput_e)},
        "c1_latency_median_s": {
            "diffusers": statistics.median(lat_d),
            "engine": statistics.median(lat_e),
        },
        "c8_images_per_s_median": {
            "diffusers": statistics.median(tput_d),
            "engine": statistics.median(tput_e),
        },
        "max_mean_pixel_diff": max(diffs),
    }
    res["c1_speedup"] = res["c1_latency_s"]["diffusers"] / res["c1_latency_s"]["engine"]
    res["c8_speedup"] = res["c8_images_per_s"]["engine"] / res["c8_images_per_s"]["diffusers"]
    print(json.dumps(res), flush=True)
    if step_time:
        res["step_ms"] = transformer_step_ms(case, compile_)
    return res


def transformer_step_ms(case: Case, compile_: bool, iters: int = 10) -> dict:
    """One denoising step at batch 1: diffusers' transformer forward vs the engine's step."""
    eng, adapter = case.engine, case.engine.adapter
    r = eng.add_request(case.request(0))
    eng.step()  # encode + first step: the state now holds real inputs
    state = eng.scheduler.find(r.request_id)
    latents = state.latents

    def engine_step():
        state.step, state.latents = 0, latents
        adapter.denoise([state])

    p = case.pipe
    emb = state.cond["embeds"]
    if case.glm:
        # As diffusers' GLM loop: inputs built once, the latents cast to the transformer dtype.
        kw = dict(
            hidden_states=latents.to(p.transformer.dtype),
            encoder_hidden_states=emb,
            prior_token_id=state.cond["prior"],
            prior_token_drop=torch.zeros_like(state.cond["prior"], dtype=torch.bool),
            timestep=state.timesteps[:1] - 1,
            target_size=torch.tensor([[case.size, case.size]], dtype=emb.dtype, device=case.device),
            crop_coords=torch.zeros(1, 2, dtype=emb.dtype, device=case.device),
            return_dict=False,
        )
    else:
        h = case.size // 16
        kw = dict(
            hidden_states=latents,
            timestep=state.timesteps[:1].to(latents.dtype) / 1000,
            guidance=torch.full([1], 3.5, device=case.device, dtype=torch.float32),
            pooled_projections=state.cond["pooled"],
            encoder_hidden_states=emb,
            txt_ids=torch.zeros(emb.shape[1], 3, device=case.device, dtype=latents.dtype),
            img_ids=p._prepare_latent_image_ids(1, h, h, case.device, latents.dtype),
            joint_attention_kwargs={},
            return_dict=False,
        )

    def diffusers_step():  # the transformer call(s) of one step of diffusers' denoising loop
        out = p.transformer(**kw)
        if case.glm and state.do_cfg:  # GLM-Image CFG: a second, unconditional pass
            neg = state.cond["neg"]
            drop = torch.ones_like(kw["prior_token_drop"])
            out = p.transformer(**{**kw, "encoder_hidden_states": neg, "prior_token_drop": drop})
        return out

    out = {}
    fns = [("diffusers_eager", diffusers_step), ("engine_eager", engine_step)]
    if compile_:
        fns.append(("engine_compiled", engine_step))
    with torch.inference_mode():
        for name, fn in fns:
            if name == "engine_compiled":
                adapter.transformer = torch.compile(case.pipe.transformer)
            for _ in range(3):
                fn()
            times = [case.timed(fn)[0] for _ in range(iters)]
            out[name] = 1000 * min(times)
            print(f"  {case.name} one step batch 1 {name}: {out[name]:.1f} ms", flush=True)
    adapter.transformer = case.pipe.transformer
    eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    return out


# ---- --step-variants: one FLUX.1-dev-size step under each speed option --------------------
# (name, accelerate_transformer options, engine path?, predicted ms on the H200, est. cost s)
# Predictions: linears ~60 TFLOP at ~740 TFLOP/s = ~80 ms; attention 14.9 TFLOP: flash (v2)
# ~380 TFLOP/s = ~39 ms, cuDNN ~600 = ~25 ms; compile fuses the ~10 ms of elementwise work.
STEP_VARIANTS: list[tuple[str, dict, bool, float, float]] = [
    ("diffusers_eager", {}, False, 174.6, 5),
    ("engine_eager", {}, True, 175.7, 5),
    ("eager_cudnn", {"attention_backend": "cudnn"}, True, 160, 5),
    ("eager_cudnn_fqkv", {"attention_backend": "cudnn", "fuse_qkv": True}, True, 157, 8),
    (
        "regional_cudnn_fqkv",
        {"compile": True, "regional": True, "attention_backend": "cudnn", "fuse_qkv": True},
        True,
        113,
        60,
    ),
    ("regional_flash", {"compile": True, "regional": True}, True, 130, 60),
    (
        "regional_cudnn",
        {"compile": True, "regional": True, "attention_backend": "cudnn"},
        True,
        116,
        60,
    ),
    (
        "full_cudnn_fqkv",
        {"compile": True, "attention_backend": "cudnn", "fuse_qkv": True},
        True,
        112,
        150,
    ),
    ("full_flash", {"compile": True}, True, 130.3, 150),
    (
        "regional_cudnn_fqkv_autotune",
        {
            "compile": True,
            "regional": True,
            "attention_backend": "cudnn",
            "fuse_qkv": True,
            "mode": "max-autotune-no-cudagraphs",
        },
        True,
        110,
        200,
    ),
]
PROFILED = {"regional_cudnn_fqkv", "regional_flash"}


def flux_step_flops(cfg, image_tokens: int, text_tokens: int = 512) -> float:
    """Matmul FLOPs of one FLUX transformer forward, batch 1.

    Per block and token: 12 inner^2 weights (QKV 3, out 1, MLP 8 for each double-block stream;
    QKV 3, MLP-in 4, out 5 for a single block), 2 FLOPs each; attention 4 N inner per token.
    """
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    n = image_tokens + text_tokens
    layers = cfg.num_layers + cfg.num_single_layers
    return layers * (24 * inner * inner * n + 4 * n * n * inner)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def time_ms(fn, device: torch.device, warmup: int, iters: int) -> tuple[float, float]:
    """(median, min) ms of `fn`, device events on CUDA."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
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
    return statistics.median(times), min(times)


def kernel_split(fn, device: torch.device) -> dict[str, float]:
    """Share of device time by kernel kind over one call: gemm / attention / other (ms)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    top: list[tuple[float, str]] = []
    for ev in prof.key_averages():
        if device.type == "cuda":  # kernels only (ops would count their kernels twice)
            us = ev.self_device_time_total if str(ev.device_type).endswith("CUDA") else 0
        else:
            us = ev.self_cpu_time_total if ev.key.startswith("aten::") else 0
        if us <= 0:
            continue
        k = ev.key.lower()
        if any(w in k for w in ("flash", "fmha", "cudnn", "attention", "sdpa")):
            split["attention"] += us / 1000
        elif any(w in k for w in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "mm", "linear")):
            split["gemm"] += us / 1000
        else:
            split["other"] += us / 1000
        top.append((us / 1000, ev.key[:70]))
    for ms, key in sorted(top, reverse=True)[:6]:
        print(f"    {ms:8.2f} ms  {key}", flush=True)
    return split


def step_variants(smoke: bool, budget_s: float, only: list[str] | None) -> None:
    """Build only the FLUX.1-dev-size model and time one step (batch 1) per speed option."""
    from vllm_omni_plugin.diffusion.acceleration import accelerate_transformer, reset_transformer

    t0 = time.perf_counter()
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    size = 64 if smoke else 1024
    warmup, iters = (1, 2) if smoke else (3, 10)
    pipe = flux_pipe("full", device, dtype, smoke).to(device)
    tr = pipe.transformer
    adapter = FluxAdapter(pipe, device, dtype, {})
    cfg = DiffusionEngineConfig(model="flux-dev-size", device=str(device), max_batch_size=1)
    cfg.dtype = str(dtype).split(".")[-1]
    engine = DiffusionEngine(cfg, adapter=adapter)
    engine.add_request(
        GenerationRequest("s", PROMPTS[1], height=size, width=size, num_inference_steps=4, seed=0)
    )
    engine.step()  # encode + first step: the state now holds real inputs
    state = engine.scheduler.find("s")
    latents = state.latents
    emb = state.cond["embeds"]
    kw = dict(  # what diffusers' loop passes the transformer at this step
        hidden_states=latents,
        timestep=state.timesteps[:1].to(latents.dtype) / 1000,
        guidance=torch.full([1], 3.5, device=device, dtype=torch.float32),
        pooled_projections=state.cond["pooled"],
        encoder_hidden_states=emb,
        txt_ids=torch.zeros(emb.shape[1], 3, device=device, dtype=latents.dtype),
        img_ids=pipe._prepare_latent_image_ids(1, size // 16, size // 16, device, latents.dtype),
        joint_attention_kwargs={},
        return_dict=False,
    )
    flops = flux_step_flops(tr.config, (size // 16) ** 2, emb.shape[1])
    with torch.inference_mode():
        ref = tr(**kw)[0]  # bf16 eager: the baseline every variant must match
        tr.float()  # float32 reference on the same (bf16-representable) weights and inputs
        kw32 = {
            k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in kw.items()
        }
        ref32 = tr(**kw32)[0]
        tr.to(dtype)  # exact: the weights were bf16 to begin with
        del kw32
    base_err = rel_err(ref, ref32)
    print(
        f"built in {time.perf_counter() - t0:.1f}s; {flops / 1e12:.2f} TFLOP/step; "
        f"bf16 eager vs float32: rel err {base_err:.2e}",
        flush=True,
    )

    def engine_step():
        state.step, state.latents = 0, latents
        adapter.denoise([state])

    rows = []
    for name, opts, on_engine, predicted, cost in STEP_VARIANTS:
        if only and name not in only:
            continue
        left = budget_s - (time.perf_counter() - t0)
        if cost > left:
            print(f"  skip {name}: needs ~{cost:.0f}s, {left:.0f}s left", flush=True)
            continue

        def run_variant(name=name, opts=opts, on_engine=on_engine, predicted=predicted):
            reset_transformer(tr)
            torch._dynamo.reset()
            fn = accelerate_transformer(tr, device, **opts)
            adapter.transformer = fn
            with torch.inference_mode():
                tc = time.perf_counter()
                out = fn(**kw)[0]  # first call: compiles where compiled
                sync(device)
                first_s = time.perf_counter() - tc
                med, best = time_ms(
                    engine_step if on_engine else lambda: tr(**kw), device, warmup, iters
                )
                out = fn(**kw)[0]  # after warm-up (autotuned kernels) too
                split = kernel_split(engine_step, device) if name in PROFILED else None
            err, err32 = rel_err(out, ref), rel_err(out, ref32)
            ok = bool(torch.isfinite(out).all()) and err32 <= 2 * base_err + 1e-3
            row = dict(
                variant=name,
                options=opts,
                predicted_ms=predicted,
                median_ms=med,
                min_ms=best,
                first_call_s=first_s,
                tflops=flops / (med / 1000) / 1e12,
                rel_err_vs_eager=err,
                rel_err_vs_fp32=err32,
                ok=ok,
                kernel_ms=split,
            )
            return row

        try:
            row = run_variant()
        except Exception as exc:  # one failing option must not cost the other measurements
            print(f"  {name} FAILED: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            continue
        rows.append(row)
        print(json.dumps(row), flush=True)
    reset_transformer(tr)
    adapter.transformer = tr
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.machine()
    extra = ""
    if device.type == "cuda":
        bf16_red = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        extra = (
            f"cudnn {torch.backends.cudnn.version()}, bf16 reduced-precision reduction {bf16_red}"
        )
    print(f"\nmachine: {name}; torch {torch.__version__} {extra}; command: {' '.join(sys.argv)}")
    print(
        f"FLUX.1-dev-size step, {size}x{size}, batch 1, {flops / 1e12:.1f} TFLOP; bf16 vs fp32 {base_err:.1e}"
    )
    print(
        f"{'variant':<30} {'pred ms':>8} {'median':>8} {'min':>8} {'TFLOP/s':>8} {'1st s':>6} {'err/eager':>10} {'err/fp32':>9} ok"
    )
    for r in rows:
        print(
            f"{r['variant']:<30} {r['predicted_ms']:>8.1f} {r['median_ms']:>8.1f} {r['min_ms']:>8.1f} "
            f"{r['tflops']:>8.0f} {r['first_call_s']:>6.1f} {r['rel_err_vs_eager']:>10.2e} "
            f"{r['rel_err_vs_fp32']:>9.2e} {'yes' if r['ok'] else 'NO'}"
        )
    print(json.dumps({"machine": name, "torch": torch.__version__, "step_variants": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", default=None, help="tiny | small | cpu (both) | full | full-flux | full-glm"
    )
    ap.add_argument("--gpu", action="store_true", help="the full-size configs on cuda in bf16")
    ap.add_argument("--model", default=None, help="tiny FLUX folder (default: build one)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time the step with torch.compile")
    ap.add_argument("--smoke", action="store_true", help="full configs with 1 block, 64 px, on CPU")
    ap.add_argument(
        "--step-variants",
        action="store_true",
        help="FLUX.1-dev-size transformer only: one step per speed option (GPU; --smoke on CPU)",
    )
    ap.add_argument("--variants", default=None, help="comma list of --step-variants names")
    ap.add_argument("--budget-s", type=float, default=300, help="--step-variants time budget")
    args = ap.parse_args()
    if args.step_variants:
        only = args.variants.split(",") if args.variants else None
        step_variants(args.smoke, args.budget_s, only)
        return
    config = args.config or ("full" if args.gpu else "cpu")
    gpu = (args.gpu or config.startswith("full")) and not args.smoke
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    full_size = 64 if args.smoke else 1024
    names = {"cpu": ["tiny", "small"], "full": ["full-flux", "full-glm"]}.get(config, [config])
    results = []
    for name in names:
        t0 = time.perf_counter()
        if name == "tiny":
            case = Case(
                name, tiny_flux_pipe(args.model), FluxAdapter, 64, args.steps or 4, device, dtype
            )
        elif name == "small":
            case = Case(
                name,
                flux_pipe("small", device, dtype).to(device),
                FluxAdapter,
                256,
                args.steps or 4,
                device,
                dtype,
            )
        elif name == "full-flux":
            case = Case(
                name,
                flux_pipe("full", device, dtype, args.smoke).to(device),
                FluxAdapter,
                full_size,
                args.steps or 4,
                device,
                dtype,
            )
        elif name == "full-glm":
            case = Case(
                name,
                glm_pipe(device, dtype, args.smoke).to(device),
                GlmImageAdapter,
                full_size,
                args.steps or 4,
                device,
                dtype,
            )
        else:
            raise SystemExit(f"unknown config {name}")
        built = time.perf_counter() - t0
        res = run_case(case, args.repeats, step_time=gpu or args.smoke, compile_=args.compile)
        res["build_s"] = built
        results.append(res)
        del case
        if gpu:
            torch.cuda.empty_cache()
    machine = f"{platform.machine()} {torch.get_num_threads()} threads"
    if gpu:
        machine = torch.cuda.get_device_name()
    print(f"\nmachine: {machine}; torch {torch.__version__}; command: {' '.join(sys.argv)}")
    hdr = (
        f"{'config':<10} {'c1 lat diffusers':>17} {'c1 lat engine':>14} {'c1 x':>6} "
        f"{'c8 img/s diff':>14} {'c8 img/s eng':>13} {'c8 x':>6} {'pixdiff':>8}"
    )
    print(hdr)
    for r in results:
        lat, tp = r["c1_latency_s"], r["c8_images_per_s"]
        print(
            f"{r['config']:<10} {lat['diffusers']:>16.3f}s {lat['engine']:>13.3f}s {r['c1_speedup']:>6.2f} "
            f"{tp['diffusers']:>14.2f} {tp['engine']:>13.2f} {r['c8_speedup']:>6.2f} {r['max_mean_pixel_diff']:>8.3f}"
        )
        if "step_ms" in r:
            print(
                f"{'':<10} one step, batch 1: "
                + ", ".join(f"{k} {v:.1f} ms" for k, v in r["step_ms"].items())
            )
    print(json.dumps({"machine": machine, "torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
