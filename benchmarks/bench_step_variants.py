"""One FLUX.1-dev-size denoising step (batch 1) under each speed option of the diffusion engine.

    python benchmarks/bench_step_variants.py                 # GPU, bf16, 1024x1024
    python benchmarks/bench_step_variants.py --smoke         # CPU, one block each, 64x64
    python benchmarks/bench_step_variants.py --variants eager_cudnn,regional_flash

(also `bench_diffusion.py --step-variants`). Builds only the transformer-size model, times
diffusers' eager step and the engine's step per option of `accelerate_transformer` (attention
backend, fused QKV, regional or full torch.compile), with the step's FLOPs, achieved TFLOP/s,
first-call (compile) time and the error against eager bf16 and fp32; a kernel-time split for
the options in PROFILED. Options run cheapest first within --budget-s.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
from diffusion_models import PROMPTS, flux_pipe, kernel_times, rel_err, sync, time_ms

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.adapters.flux import FluxAdapter

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


def kernel_split(fn, device: torch.device) -> dict[str, float]:
    """Share of device time by kernel kind over one call: gemm / attention / other (ms)."""
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    top: list[tuple[float, str]] = []
    for key, ms in kernel_times(fn, device):
        k = key.lower()
        if any(w in k for w in ("flash", "fmha", "cudnn", "attention", "sdpa")):
            split["attention"] += ms
        elif any(w in k for w in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "mm", "linear")):
            split["gemm"] += ms
        else:
            split["other"] += ms
        top.append((ms, key[:70]))
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
    ap.add_argument("--smoke", action="store_true", help="CPU, one block each, 64 px")
    ap.add_argument("--variants", default=None, help="comma list of option names")
    ap.add_argument("--budget-s", type=float, default=300, help="time budget")
    args = ap.parse_args()
    step_variants(args.smoke, args.budget_s, args.variants.split(",") if args.variants else None)


if __name__ == "__main__":
    main()
